"""The asyncio front: one request's events as an async iterator, fed through its event loop's mailbox.

Events cross from the engine thread to the event loop through a `LoopMailbox` (at most one loop
wakeup per burst), so the loop never waits on a lock held across a forward pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from functools import partial

from tandem.decoder.engine.front.mailbox import LoopMailbox
from tandem.decoder.engine.outputs.backpressure import ReaderProgress, unread_weight
from tandem.decoder.engine.outputs.outputs import Delta, Event, Failed, Finished
from tandem.decoder.engine.step.core import EventCallback


class Mailboxes:
    """One mailbox per event loop, shared by all of that loop's streams."""

    def __init__(self) -> None:
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def of(self, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        with self._lock:
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = LoopMailbox(loop)
            return mailbox


async def stream_events(
    mailboxes: Mailboxes,
    submit: Callable[[EventCallback], str],
    abort: Callable[[str], None],
    builder: concurrent.futures.Executor,
    progress: ReaderProgress,
) -> AsyncIterator[Event]:
    """Submits through `submit` (which returns the engine's key) on `builder`, off the event loop,
    and yields the request's events.

    Leaving early (cancel, error) aborts the request, also when the caller leaves while it is still
    being built. A consumer that falls behind gets the deltas that piled up as one (vLLM's output
    collector does the same): every message costs the server CPU the model needs, so a slow stream
    sends fewer, fuller messages instead of a growing backlog. `progress` counts the Deltas handed
    over and taken, so that a request whose reader stops taking them pauses (outputs/backpressure.py).
    """
    mailbox = mailboxes.of(asyncio.get_running_loop())
    events: asyncio.Queue[Event] = asyncio.Queue()

    def on_event(event: Event) -> None:
        if isinstance(event, Delta):
            progress.handed(unread_weight(event.token_ids, event.prompt_logprobs))
        mailbox.post(events, event)

    admission = builder.submit(submit, on_event)
    try:
        key = await asyncio.wrap_future(admission)
    except asyncio.CancelledError:
        admission.add_done_callback(partial(_abort_if_admitted, abort, progress))
        raise
    except BaseException:
        progress.close()
        raise
    finished = False
    held: Event | None = None  # taken from the queue while merging, not yet yielded
    try:
        while True:
            if held is not None:
                event, held = held, None
            else:
                event = await events.get()
            num_taken = (
                unread_weight(event.token_ids, event.prompt_logprobs) if isinstance(event, Delta) else 0
            )
            while isinstance(event, Delta) and not events.empty():
                later = events.get_nowait()
                if not isinstance(later, Delta):
                    held = later
                    break
                event = event.followed_by(later)
                num_taken += unread_weight(later.token_ids, later.prompt_logprobs)
            if num_taken:
                progress.taken(num_taken)
            yield event
            if isinstance(event, Finished | Failed):
                finished = True
                return
    finally:
        if not finished:
            abort(key)
        progress.close()


def _abort_if_admitted(
    abort: Callable[[str], None], progress: ReaderProgress, admission: concurrent.futures.Future[str]
) -> None:
    """The caller left while its request was being built: abort it if it was admitted after all."""
    if not admission.cancelled() and admission.exception() is None:
        abort(admission.result())
    progress.close()
