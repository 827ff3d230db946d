"""What an Embed call's failure was, for `encoder_parts.py`: the encoder's silence, this decoder's own
limit, a reply wrong in itself, or gRPC's own failure of the call.

Its own module, apart from the fetching: a fetch shared by several parts (`shared_fetches.py`) fails
once and each waiter names its own field, so the failure travels as an error the waiter classifies
(`ran_out`: fetched again by one with time left; `is_grpcs_own`: "could not be reached").
"""

from __future__ import annotations

import grpc

from tandem.client import grpc_failures
from tandem.common import replica_name


class NoPlace(Exception):
    """An Embed call never made: its fetch's time ran out while every one of the MAX_EMBEDS_IN_FLIGHT
    places was taken. This decoder's own limit, not the encoder's silence."""


class FaultyReply(grpc.aio.AioRpcError):
    """A reply this decoder found wrong in itself: its words are the decoder's, not gRPC's own."""


def unavailable(details: str, replica: str | None) -> grpc.aio.AioRpcError:
    """UNAVAILABLE as the encoder's call would raise it: each waiter names its own field, and the WARNING
    line the encoder (`replica`, the one that sent the faulty reply, where it said; `encoder_errors.py`)."""
    initial = grpc.aio.Metadata((replica_name.HEADER, replica)) if replica else grpc.aio.Metadata()
    return FaultyReply(grpc.StatusCode.UNAVAILABLE, initial, grpc.aio.Metadata(), details)


def is_grpcs_own(error: grpc.aio.AioRpcError) -> bool:
    """Whether `error` is gRPC's own failure of the call (no connection, one lost), not the encoder's
    status (`grpc_failures.is_grpcs_own`), nor this decoder's own word on a faulty reply: a FaultyReply
    carries no google.rpc details either, and keeps its words."""
    return not isinstance(error, FaultyReply) and grpc_failures.is_grpcs_own(error)


def encoder_named(address: str, error: grpc.aio.AioRpcError) -> str:
    """The encoder to name for `error`: the replica that took the call, where it said so (as the call
    began, before any work: a hung one too); else `address` as configured, all of them where several
    (none answered: every one unreachable, or one from before replicas said)."""
    return replica_name.answering(address, replica_name.reported(error.initial_metadata()))


def ran_out(error: BaseException) -> bool:
    """Whether a call failed for want of time: a caller with more of its own fetches again."""
    if isinstance(error, NoPlace):
        return True
    return isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
