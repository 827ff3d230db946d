"""The filter `start_server` puts on grpc.aio's logger: no traceback for a send on a call already over."""

from __future__ import annotations

import logging


class _CallOverFilter(logging.Filter):
    """Drops grpc.aio's traceback for a message it could not send on a call that is already over.

    A send fails in gRPC's core only once the call has ended on the wire: its client cancelled or
    went away, its deadline passed, or the server is stopping. grpc.aio says nothing when it saw the
    client's cancel first, and logs the failed send with a traceback when the send's failure came
    first, a race: cancelling 640 unread streams logged 59 of them. Either way the call is over and
    its client knows why; nothing in it is the server's to fix.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(GRPC_FAILED_SEND_MESSAGE)


GRPC_LOGGER = "grpc._cython.cygrpc"
GRPC_FAILED_SEND_MESSAGE = "ExecuteBatchError raised in core"  # grpc/_cython/_cygrpc/aio/server.pyx.pxi
CALL_OVER_FILTER = _CallOverFilter()
