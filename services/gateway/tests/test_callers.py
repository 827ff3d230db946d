"""Each HTTP caller's own channel to the decoder: one per caller while it has calls open, reused,
and idle ones beyond the bound closed, least recently used first."""

from __future__ import annotations

import asyncio

from tandem.gateway.callers import CallerChannels, caller_of


class FakeChannel:
    def __init__(self, name: int) -> None:
        self.name, self.is_closed = name, False

    async def close(self) -> None:
        self.is_closed = True

    def unary_stream(self, *args: object, **kwargs: object) -> None:  # what a DecoderStub binds
        return None

    unary_unary = stream_unary = stream_stream = unary_stream


class FakeReplicas:
    """The replicas that serve, as `tandem.gateway.replicas.Replicas` tells them to CallerChannels."""

    def __init__(self, targets: tuple[str, ...]) -> None:
        self.targets = targets
        self.on_change = lambda: None

    def start(self) -> None:
        pass

    def change(self, targets: tuple[str, ...]) -> None:
        self.targets = targets
        self.on_change()

    async def close(self) -> None:
        pass


def _channels(max_idle: int) -> tuple[CallerChannels, list[FakeChannel]]:
    opened: list[FakeChannel] = []

    def open_channel(targets: tuple[str, ...]) -> FakeChannel:
        opened.append(FakeChannel(len(opened)))
        return opened[-1]

    return CallerChannels(open_channel, max_idle, FakeReplicas(("a:1",))), opened  # type: ignore[arg-type]


async def test_a_callers_calls_share_its_channel_and_other_callers_get_their_own() -> None:
    channels, opened = _channels(max_idle=4)
    async with channels.stub("peer:a") as a1, channels.stub("peer:a") as a2, channels.stub("peer:b") as b:
        assert a1 is a2 and a1 is not b
        assert len(opened) == 2
    async with channels.stub("peer:a") as again:
        assert again is a1  # kept while idle, within the bound
    assert len(opened) == 2 and not any(c.is_closed for c in opened)


async def test_idle_channels_beyond_the_bound_are_closed_least_recently_used_first() -> None:
    channels, opened = _channels(max_idle=1)
    async with channels.stub("peer:a"), channels.stub("peer:b"):
        pass
    async with channels.stub("peer:c"):
        await asyncio.sleep(0)
        assert [c.is_closed for c in opened] == [True, False, False]  # a: oldest idle; b kept; c open
    await asyncio.sleep(0)
    assert [c.is_closed for c in opened] == [True, True, False]
    assert channels.num_channels == 1
    await channels.close()
    assert all(c.is_closed for c in opened)


def test_a_caller_is_its_checked_token_else_its_address() -> None:
    assert caller_of("Bearer t1", "10.0.0.1", tokens_checked=True) == caller_of("Bearer t1", "10.0.0.2", True)
    assert caller_of("Bearer t1", "10.0.0.1", True) != caller_of("Bearer t2", "10.0.0.1", True)
    # An unchecked token says nothing: a caller could send a new one with each request.
    assert caller_of("Bearer t1", "10.0.0.1", False) == caller_of("Bearer t2", "10.0.0.1", False)
    assert "t1" not in caller_of("Bearer t1", "10.0.0.1", True)  # a digest, never the secret


async def test_when_the_serving_replicas_change_a_callers_next_call_opens_a_channel_over_them() -> None:
    replicas = FakeReplicas(("a:1", "b:1"))
    opened: list[tuple[tuple[str, ...], FakeChannel]] = []

    def open_channel(targets: tuple[str, ...]) -> FakeChannel:
        opened.append((targets, FakeChannel(len(opened))))
        return opened[-1][1]

    channels = CallerChannels(open_channel, 4, replicas)  # type: ignore[arg-type]
    async with channels.stub("peer:busy"):
        async with channels.stub("peer:idle"):
            pass
        replicas.change(("a:1",))  # b is loading, draining or failed
        await asyncio.sleep(0)
        assert [c.is_closed for _, c in opened] == [False, True]  # the idle one at once
        async with channels.stub("peer:busy"):  # a new call: a new channel, the stream goes on
            assert [targets for targets, _ in opened] == [("a:1", "b:1"), ("a:1", "b:1"), ("a:1",)]
    await asyncio.sleep(0)
    assert [c.is_closed for _, c in opened] == [True, True, False]  # the busy one once its calls ended
    await channels.close()
