"""A service's stop on SIGTERM or SIGINT: a graceful drain, never a traceback."""

from __future__ import annotations

import asyncio
import logging
import signal


def stop_on_signals(grace_s: float, logger: logging.Logger) -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT (a graceful stop, not a traceback); a second
    signal only says that the service is already draining."""
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            logger.info("received %s: already draining", sig.name)
            return
        logger.info("received %s: draining for up to %g s", sig.name, grace_s)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return stop
