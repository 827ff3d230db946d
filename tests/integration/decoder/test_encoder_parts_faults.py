"""What a decoder does when its encoder misbehaves: a reply naming a segment this call did not ask for
(forged, or replayed from an earlier call), past its segment, or of a wrong dtype is UNAVAILABLE naming
the encoder (never INVALID_ARGUMENT on the caller's field: callers pass no handles); a segment gone,
changed, cut, or that cannot be opened, before it was read (its lease ran out) is fetched again by
value, and UNAVAILABLE only if that fails too; an encoder that is down is UNAVAILABLE naming it, in
seconds; a call cancelled while its rows are fetched leaves no thread waiting and releases its segment
at once. The encoder here is a stand-in that writes real segments (the encoder's own SharedSegments)
and then says what each test needs."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from tandem.client.client import EncoderPart
from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import (
    decoder_pb2,
    decoder_pb2_grpc,
    encoder_pb2,
    encoder_pb2_grpc,
    tensor_pb2,
)
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.common.torch_part import shared_memory, shm_segment_maps, tensors
from tandem.common.torch_part.prompt_parts import EncoderPrompt
from tandem.decoder.api.encoder_parts import EncoderParts
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.models.loader import LoadedModel
from tandem.encoder.shared_segments import SharedSegments
from tests.integration.decoder.conftest import MAX_MESSAGE_BYTES, Served, serve, shutdown

Reply = Callable[[encoder_pb2.EmbedRequest, grpc.aio.ServicerContext], Awaitable[encoder_pb2.EmbedResponse]]


class StandIn(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, segments: SharedSegments) -> None:
        self.segments = segments
        self.reply: Reply = self.honest
        self.handles: list[tensor_pb2.SharedTensor] = []  # every segment written, in order

    async def GetModelInfo(self, request, context) -> encoder_pb2.EncoderGetModelInfoResponse:
        return encoder_pb2.EncoderGetModelInfoResponse(model="stand-in", hidden_size=64)

    async def Embed(self, request, context) -> encoder_pb2.EmbedResponse:
        return await self.reply(request, context)

    def write(self, request: encoder_pb2.EmbedRequest, num_rows: int = 3) -> tensor_pb2.SharedTensor:
        target = self.segments.target(request.shared_memory)
        assert target is not None, "the decoder's offer proves one host"
        handle = target.write(torch.randn(num_rows, 64) * 0.1, torch.float32)
        assert handle is not None
        self.handles.append(handle)
        return handle

    async def honest(self, request, context) -> encoder_pb2.EmbedResponse:
        return encoder_pb2.EmbedResponse(shared_embeddings=self.write(request))


@dataclass
class Rig:
    stand_in: StandIn
    decoder: Served
    parts: EncoderParts
    directory: Path


@pytest.fixture
async def rig(tiny_model_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path) -> AsyncIterator[Rig]:
    segments = SharedSegments(tmp_path, max_bytes=1 << 20, max_segments=16, lease_s=0.5)
    stand_in = StandIn(segments)
    server = await _serve_encoder(stand_in)
    parts = EncoderParts(server.address, torch.float32, MAX_MESSAGE_BYTES, cache_bytes=0, shm_dir=tmp_path)
    decoder = await serve(tiny_model_dir, tiny_fp32, encoder_parts=parts)
    try:
        yield Rig(stand_in, decoder, parts, tmp_path)
    finally:
        await shutdown(decoder)
        await parts.close()
        await server.stop(0)
        segments.close()


async def _serve_encoder(servicer: encoder_pb2_grpc.EncoderServicer) -> RunningServer:
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0),
        [Service("tandem.v1.Encoder", servicer, encoder_pb2_grpc.add_EncoderServicer_to_server)],
    )
    await server.set_serving()
    return server


async def _generate(decoder: Served, text: str = "hello") -> list[int]:
    call = decoder.client.generate([EncoderPart(text=text), "and then"], max_new_tokens=2, temperature=0)
    return [t async for r in call if r.HasField("delta") for t in r.delta.token_ids]


async def _refused(decoder: Served) -> grpc.aio.AioRpcError:
    """The error of one Generate call, on a channel that does not retry: the client's own retries
    UNAVAILABLE (1.5 s of backoff here)."""
    request = decoder_pb2.GenerateRequest()
    request.prompt.add().encoder.text = "hello"
    request.stopping.max_new_tokens = 2
    async with grpc.aio.insecure_channel(decoder.server.address, options=[("grpc.enable_retries", 0)]) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [r async for r in decoder_pb2_grpc.DecoderStub(ch).Generate(request, timeout=10)]
    return refused.value


def _the_encoders_fault(rig: Rig, error: grpc.aio.AioRpcError) -> str:
    """What the encoder's reply did wrong, from an error that blames the encoder, never the caller's
    input: it was INVALID_ARGUMENT on prompt[0].encoder.shared_embeddings.*, which no caller passes."""
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
    unavailable = "prompt[0].encoder: the encoder is unavailable (UNAVAILABLE: its reply's "
    assert error.details().startswith(unavailable), error.details()
    return error.details().removeprefix(unavailable)


async def test_an_honest_reply_is_read_and_its_segment_released_for_the_next(rig: Rig) -> None:
    for _ in range(2):
        assert len(await _generate(rig.decoder)) == 2
    assert rig.parts.num_shared == 2
    assert not any(shared_memory.exists(rig.directory, h.name) for h in rig.stand_in.handles)
    assert rig.stand_in.segments.num_leased == 0
    assert rig.stand_in.segments.num_created == 1  # the second call's rows went into the first's segment
    assert rig.parts.replies.maps.num_mapped == 1  # which the decoder read through the mapping it kept


async def test_a_handle_of_a_few_rows_is_opened_off_the_event_loop(rig: Rig) -> None:
    """Opening a pool segment the decoder has not seen maps all of it (MAP_POPULATE: 60-94 ms for the
    encoder's largest, 1 GiB), whatever the handle's rows; on the loop, every stream and health check
    of the decoder waited for it."""
    loop_thread = threading.get_ident()
    opened_on: list[int] = []  # the thread of each open
    open_segment = rig.parts.replies.maps.open

    def recording(name: str) -> shm_segment_maps.Segment | None:
        opened_on.append(threading.get_ident())
        return open_segment(name)

    rig.parts.replies.maps.open = recording  # type: ignore[method-assign]
    assert len(await _generate(rig.decoder)) == 2
    assert rig.stand_in.handles[0].shape == [3, 64]  # 768 bytes of rows
    assert len(opened_on) == 1 and opened_on[0] != loop_thread


async def test_a_reply_naming_a_segment_this_call_did_not_ask_for_is_refused(rig: Rig) -> None:
    async def forged(request, context):
        rig.stand_in.write(request)  # the segment asked for exists; the handle names another one
        other = rig.stand_in.write(request.__class__(shared_memory=_other_offer(request.shared_memory)))
        return encoder_pb2.EmbedResponse(shared_embeddings=other)

    rig.stand_in.reply = forged
    fault = _the_encoders_fault(rig, await _refused(rig.decoder))
    assert fault == ".shared_embeddings.name: names a segment this call did not ask for)"
    assert shared_memory.exists(rig.directory, rig.stand_in.handles[1].name)  # never opened, never removed


async def test_a_handle_replayed_from_an_earlier_call_is_refused(rig: Rig) -> None:
    assert len(await _generate(rig.decoder)) == 2
    first = rig.stand_in.handles[0]

    async def replayed(request, context):
        return encoder_pb2.EmbedResponse(shared_embeddings=first)

    rig.stand_in.reply = replayed
    fault = _the_encoders_fault(rig, await _refused(rig.decoder))
    assert "names a segment this call did not ask for" in fault


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda h, d: h.shape.__setitem__(0, _size(d / h.name) // 256 + 1),
            ".shared_embeddings.shape: ",
        ),
        (
            lambda h, d: setattr(h, "offset", _size(d / h.name) - 768 + 4),
            ".shared_embeddings.shape: 768 bytes",
        ),
        (
            lambda h, d: setattr(h, "dtype", tensor_pb2.DATA_TYPE_INT32),
            ".shared_embeddings.dtype",
        ),
    ],
    ids=["past-its-end", "shifted-past-its-end", "not-floats"],
)
async def test_a_handle_its_segment_does_not_bear_out_is_the_encoders_fault(
    rig: Rig, change, expected
) -> None:
    async def bent(request, context):
        handle = rig.stand_in.write(request)
        change(handle, rig.directory)
        return encoder_pb2.EmbedResponse(shared_embeddings=handle)

    rig.stand_in.reply = bent
    fault = _the_encoders_fault(rig, await _refused(rig.decoder))
    assert fault.startswith(expected), fault
    assert "shape" not in expected or "run past the segment's" in fault
    assert rig.parts.num_refetched == 0  # wrong in itself: asked again, it would be wrong again
    assert not shared_memory.exists(rig.directory, rig.stand_in.handles[0].name)  # read once, or never there
    rig.stand_in.reply = rig.stand_in.honest
    assert len(await _generate(rig.decoder)) == 2  # the decoder serves on


_LOST = [
    lambda h, d: shared_memory.remove(d, h.name),  # its lease ran out, the name removed
    lambda h, d: _flip_a_byte(d / h.name),  # ran out while it was read, and the segment written again
    lambda h, d: setattr(h, "digest", bytes(16)),
]


@pytest.mark.parametrize("lose", _LOST, ids=["gone", "changed", "digest-differs"])
async def test_a_segment_lost_before_it_was_read_is_fetched_again_by_value(rig: Rig, lose) -> None:
    # It was INVALID_ARGUMENT on the caller's prompt[0].encoder.shared_embeddings.name ("the segment is
    # gone") or .digest: 7 of 180 valid calls under load with --shared-memory-lease-s at its 0.1 s floor.
    async def lost_then_bytes(request, context):
        if not request.HasField("shared_memory"):
            return encoder_pb2.EmbedResponse(embeddings=tensors.encode(torch.randn(3, 64) * 0.1))
        handle = rig.stand_in.write(request)
        lose(handle, rig.directory)
        return encoder_pb2.EmbedResponse(shared_embeddings=handle)

    rig.stand_in.reply = lost_then_bytes
    assert len(await _generate(rig.decoder)) == 2
    assert (rig.parts.num_refetched, rig.parts.num_bytes, rig.parts.num_shared) == (1, 1, 0)
    assert not shared_memory.exists(rig.directory, rig.stand_in.handles[0].name)


def _open_fails(parts: EncoderParts, monkeypatch: pytest.MonkeyPatch) -> None:
    def too_many_files(name: str) -> None:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(parts.replies.maps, "open", too_many_files)


def _shrinks_while_read(parts: EncoderParts, monkeypatch: pytest.MonkeyPatch) -> None:
    # The bounded read's answer when the file was cut after its size was checked.
    monkeypatch.setattr(shm_segment_maps.Segment, "read_digested", lambda self, offset, into, key: None)


@pytest.mark.parametrize("fault", [_open_fails, _shrinks_while_read], ids=["cannot-open", "shrank"])
async def test_a_segment_that_cannot_be_opened_or_shrank_is_fetched_again_by_value(
    rig: Rig, fault, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was INVALID_ARGUMENT on the caller's prompt[0].encoder.shared_embeddings.name ("cannot be
    # read: ...") or .shape ("the segment shrank"): this host's, or a race with the encoder's pool.
    async def offered_then_bytes(request, context):
        if not request.HasField("shared_memory"):
            return encoder_pb2.EmbedResponse(embeddings=tensors.encode(torch.randn(3, 64) * 0.1))
        return encoder_pb2.EmbedResponse(shared_embeddings=rig.stand_in.write(request))

    fault(rig.parts, monkeypatch)
    rig.stand_in.reply = offered_then_bytes
    assert len(await _generate(rig.decoder)) == 2
    assert (rig.parts.num_refetched, rig.parts.num_bytes, rig.parts.num_shared) == (1, 1, 0)
    assert not shared_memory.exists(rig.directory, rig.stand_in.handles[0].name)  # released at once


async def test_a_handle_of_rows_over_the_decoders_message_cap_is_the_callers_input_naming_the_flag(
    rig: Rig,
) -> None:
    """Rows too large for this decoder's --max-message-bytes are the caller's long input, whichever way
    they came: INVALID_ARGUMENT on the caller's field, as rows sent as bytes over gRPC's cap are. It
    named prompt[0].encoder.shared_embeddings.shape, a field no caller passes, and not the flag."""

    async def large(request, context):
        return encoder_pb2.EmbedResponse(shared_embeddings=rig.stand_in.write(request, num_rows=40))

    rig.stand_in.reply = large
    parts = EncoderParts(rig.parts.address, torch.float32, 4096, cache_bytes=0, shm_dir=rig.directory)
    try:
        spec, _ = parts.start(GenerateSpec(prompt=[EncoderPrompt("text", "hello")]), None, 10)
        (part,) = spec.prompt
        assert isinstance(part, EncoderPrompt) and part.rows is not None
        with pytest.raises(InvalidArgument) as error:
            await asyncio.wait_for(asyncio.wrap_future(part.rows), 10)
    finally:
        await parts.close()
    assert error.value.field == "prompt[0].encoder"
    assert error.value.description == (
        "the encoder's rows are larger than this decoder's --max-message-bytes 4096 allows (2560 elements "
        "exceed the limit of 2048): send a shorter input, or start the decoder with a larger "
        "--max-message-bytes"
    )
    assert not shared_memory.exists(rig.directory, rig.stand_in.handles[0].name)  # released all the same


async def test_a_refetch_that_fails_too_is_unavailable_never_the_callers_input(rig: Rig) -> None:
    offered, unoffered = [], []

    async def lost_twice(request, context):
        (offered if request.HasField("shared_memory") else unoffered).append(request)
        offer = request.shared_memory if request.HasField("shared_memory") else _fresh_offer(rig.parts)
        handle = rig.stand_in.write(encoder_pb2.EmbedRequest(shared_memory=offer))
        shared_memory.remove(rig.directory, handle.name)
        return encoder_pb2.EmbedResponse(shared_embeddings=handle)  # a handle again, unasked for

    rig.stand_in.reply = lost_twice
    # A channel that does not retry: the client's own retries UNAVAILABLE (1.5 s of backoff here).
    request = decoder_pb2.GenerateRequest()
    request.prompt.add().encoder.text = "hello"
    request.stopping.max_new_tokens = 2
    async with grpc.aio.insecure_channel(
        rig.decoder.server.address, options=[("grpc.enable_retries", 0)]
    ) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [r async for r in decoder_pb2_grpc.DecoderStub(ch).Generate(request, timeout=10)]
    error = refused.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
    assert error.details().startswith("prompt[0].encoder: the encoder is unavailable")
    assert "its segment was gone before it was read" in error.details()
    assert rig.parts.num_refetched == len(offered) == len(unoffered) == 1  # once, by value, and no more


async def test_the_segment_of_a_call_cancelled_mid_fetch_is_released_at_once(rig: Rig) -> None:
    entered, left = asyncio.Event(), asyncio.Event()

    async def stalled(request, context):
        rig.stand_in.write(request)  # written, and the reply never comes
        entered.set()
        try:
            await asyncio.sleep(3600)
        finally:
            left.set()  # cancelled by the decoder when its caller left

    rig.stand_in.reply = stalled
    call = rig.decoder.client.generate([EncoderPart(text="hello"), "more"], max_new_tokens=2)
    reading = asyncio.ensure_future(call.initial_metadata())
    await asyncio.wait_for(entered.wait(), 10)
    call.cancel()
    reading.cancel()
    await asyncio.wait_for(left.wait(), 5)  # the cancel reached the encoder call
    deadline = time.monotonic() + 5
    while _threads_waiting_for_rows() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _threads_waiting_for_rows()
    scheduler = rig.decoder.engine.core.scheduler
    assert scheduler.num_running == scheduler.num_waiting == 0
    # The decoder removed the name it asked for, as a read does: not the encoder's lease, which left
    # it leased for 0.5 s here (10 s by default), so that 40 cancelled calls held 2 of 8 segments.
    assert not shared_memory.exists(rig.directory, rig.stand_in.handles[0].name)
    assert rig.stand_in.segments.num_leased == 0 and rig.stand_in.segments.num_expired == 0
    rig.stand_in.reply = rig.stand_in.honest
    assert len(await _generate(rig.decoder)) == 2


async def test_an_encoder_that_is_down_is_unavailable_within_seconds_without_its_address(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    parts = EncoderParts(address, torch.float32, MAX_MESSAGE_BYTES, cache_bytes=0)
    decoder = await serve(tiny_model_dir, tiny_fp32, encoder_parts=parts)
    try:
        started = time.monotonic()
        error = await _refused(decoder)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert (
            error.details()
            == "prompt[0].encoder: the encoder could not be reached (no connection, or it was lost); retry"
        )
        assert time.monotonic() - started < 15  # the channel's retries, not a queue without end
        call = decoder.client.generate(["plain text"], max_new_tokens=2)  # requests without parts go on
        assert [r async for r in call if r.HasField("finished")]
    finally:
        await shutdown(decoder)
        await parts.close()


def _fresh_offer(parts: EncoderParts) -> encoder_pb2.SharedMemoryOffer:
    offer = parts.replies.offer()
    assert offer is not None
    return offer


def _other_offer(offer: encoder_pb2.SharedMemoryOffer) -> encoder_pb2.SharedMemoryOffer:
    other = encoder_pb2.SharedMemoryOffer()
    other.CopyFrom(offer)
    other.segment_name = shared_memory.new_name(shared_memory.SEGMENT_PREFIX)
    return other


def _size(path: Path) -> int:
    """A segment's bytes: the pool's size for it, at least its rows' (3 x 64 float32 here, 768 bytes)."""
    return path.stat().st_size


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[5] ^= 0x40
    path.write_bytes(bytes(data))


def _threads_waiting_for_rows() -> list[int]:
    """Threads whose stack is inside the request builder's wait for an encoder part's rows."""
    waiting = []
    for thread_id, frame in sys._current_frames().items():
        while frame is not None:
            if frame.f_code.co_name == "_fetched_rows":
                waiting.append(thread_id)
                break
            frame = frame.f_back
    return waiting
