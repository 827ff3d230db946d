"""The engine-to-loop mailbox: order kept, one wakeup for a burst, a closed loop drops quietly."""

import asyncio
import threading

from tandem.decoder.engine.front.mailbox import LoopMailbox


async def test_a_burst_from_another_thread_arrives_in_order_with_one_wakeup() -> None:
    loop = asyncio.get_running_loop()
    mailbox = LoopMailbox(loop)
    queues = [asyncio.Queue(), asyncio.Queue()]
    wakeups = 0
    schedule = loop.call_soon_threadsafe

    def counting(callback, *args):
        nonlocal wakeups
        wakeups += 1
        return schedule(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        poster = threading.Thread(target=lambda: [mailbox.post(queues[i % 2], i) for i in range(100)])
        poster.start()
        poster.join()  # the loop cannot drain while this coroutine holds it
        got = [[await q.get() for _ in range(50)] for q in queues]
    finally:
        del loop.call_soon_threadsafe
    assert got == [list(range(0, 100, 2)), list(range(1, 100, 2))]
    assert wakeups == 1


def test_posting_to_a_closed_loop_drops_the_events() -> None:
    loop = asyncio.new_event_loop()
    mailbox = LoopMailbox(loop)
    loop.close()
    mailbox.post(asyncio.Queue(), "late")  # no exception: the reader is gone
