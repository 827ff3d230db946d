"""The decoder's drain once it stops serving: no new calls, and open streams get --grace-s to finish.
Any still open then end with FINISH_REASON_ABORTED, so every stream gets its `finished` event and its
span is exported.
"""

from __future__ import annotations

import asyncio
import logging

from tandem.common.running_server import RunningServer, notice_within
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import FinishReason

log = logging.getLogger("tandem.decoder")

CUT_S = 5.0  # after the grace period: how long aborted streams get to send `finished` before gRPC cancels


async def drain(running: RunningServer, engine: Engine, grace_s: float) -> None:
    """No new calls; open streams get `grace_s` to finish, then end with FINISH_REASON_ABORTED.

    gRPC itself would cancel what is left at the deadline (callers see UNAVAILABLE and the spans are
    lost), so its deadline is CUT_S later: by then every aborted stream has sent its `finished`.
    """
    # The notice within `grace_s`, not its cut: a Generate taken after `grace_s` would not be ended
    # by finish_all below and would run until gRPC's cut.
    stopping = asyncio.ensure_future(running.stop(grace_s + CUT_S, notice_s=notice_within(grace_s)))
    try:
        done, _ = await asyncio.wait({stopping}, timeout=grace_s)
        if not done:
            num_aborted = engine.finish_all(FinishReason.ABORTED)
            log.info("grace period over: %d open requests end with FINISH_REASON_ABORTED", num_aborted)
    except BaseException:
        # A finish_all that raised, or a cancel of the drain during the grace: the server still stops
        # (gRPC cuts the streams left at the stop's deadline). The stop was left running unawaited, and
        # whoever handles this error went on with the server half stopped. This error is the one that
        # goes on; the stop's own is logged.
        await asyncio.wait({stopping})
        if not stopping.cancelled() and (stop_error := stopping.exception()) is not None:
            log.error("the server's stop failed too", exc_info=stop_error)
        raise
    await stopping
