"""An Embed reply's rows (`embed_replies.py`), through a real gRPC channel and server: a reply wrong in
itself (rows of another rank or width, NaN) is the encoder's fault, UNAVAILABLE naming it on each
caller's own field and never cached, and large rows are checked off the event loop. The encoder is the
stand-in of encoder_stand_in.py. (Rows through shared memory: tests/integration/decoder/
test_encoder_parts_faults.py.)"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from tandem.client.errors import Unavailable
from tandem.common.server import RunningServer
from tandem.common.torch_part.prompt_parts import EncoderPrompt, TextPrompt
from tandem.decoder.api import embed_replies
from tandem.decoder.api.embed_replies import READ_ON_A_THREAD_BYTES, EmbedReplies
from tandem.decoder.api.encoder_parts import EncoderParts

from .encoder_stand_in import (
    HIDDEN_SIZE,
    PICTURE,
    SETTLE_S,
    StandIn,
    fetched_rows,
    picture,
    rows_of,
    start_fetches,
)


async def test_a_malformed_reply_is_refused_to_every_caller_on_its_own_field(
    encoder: StandIn, parts: EncoderParts
) -> None:
    encoder.is_malformed = True
    [first], _ = start_fetches(parts, [picture()])
    [second], _ = start_fetches(parts, [TextPrompt("look:"), picture()])
    await asyncio.sleep(SETTLE_S)
    encoder.gate.set()
    for part, field in [(first, "prompt[0]"), (second, "prompt[1]")]:
        # The encoder's fault, never INVALID_ARGUMENT on the caller's field, as it was.
        with pytest.raises(Unavailable, match="expected rank 2") as error:
            await fetched_rows(part)
        assert str(error.value).startswith(f"{field}.encoder: the encoder is unavailable (")
        assert "its reply's .embeddings.shape: " in str(error.value)
    assert encoder.num_embeds == 1


async def test_rows_holding_nan_are_refused_and_not_cached_so_the_next_call_fetches_them_again(
    encoder: StandIn, parts: EncoderParts
) -> None:
    """An encoder's fault (a NaN in one reply) lives as long as that call, not on in the cache."""
    encoder.is_non_finite = True
    encoder.gate.set()
    [first], _ = start_fetches(parts, [picture()])
    with pytest.raises(Unavailable) as error:
        await fetched_rows(first)
    assert str(error.value).startswith("prompt[0].encoder: the encoder is unavailable (")
    assert "its reply's .embeddings.data: " in str(error.value)
    assert "NaN or Inf as sent, in float32 (first at index [1, 2])" in str(error.value)
    encoder.is_non_finite = False
    [again], _ = start_fetches(parts, [picture()])
    assert torch.equal(await fetched_rows(again), rows_of(PICTURE))
    assert encoder.num_embeds == 2


async def test_rows_of_another_width_are_the_encoders_fault_and_not_cached_so_its_fix_mends_them(
    encoder: StandIn, parts: EncoderParts
) -> None:
    """Rows [3, 2 x hidden] are the encoder's fault (another model), UNAVAILABLE, as NaN is:
    they were INVALID_ARGUMENT on the caller's field, cached, and refused again once the encoder was
    fixed."""
    encoder.rows = torch.ones(3, 2 * HIDDEN_SIZE)
    encoder.gate.set()
    [first], _ = start_fetches(parts, [picture()])
    with pytest.raises(Unavailable) as error:
        await fetched_rows(first)
    assert str(error.value).startswith("prompt[0].encoder: the encoder is unavailable (")
    assert f"its reply's .embeddings.shape: rows [3, {2 * HIDDEN_SIZE}], this decoder's model takes" in str(
        error.value
    )
    encoder.rows = None
    [again], _ = start_fetches(parts, [picture()])
    assert torch.equal(await fetched_rows(again), rows_of(PICTURE))
    assert encoder.num_embeds == 2


async def test_rows_over_a_mebibyte_are_checked_off_the_event_loop(
    encoder: StandIn, stand_in: tuple[StandIn, RunningServer], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cast and the finiteness check of large rows (163 ms for 8,192 x 4,096 bf16 rows) would hold
    every stream and health check of the decoder while they ran on its loop."""
    checked_on: list[bool] = []  # whether each check ran on the event loop's thread
    check = EmbedReplies._checked

    def recording(self: EmbedReplies, rows: torch.Tensor, where: str) -> torch.Tensor:
        checked_on.append(threading.current_thread() is threading.main_thread())
        return check(self, rows, where)

    monkeypatch.setattr(EmbedReplies, "_checked", recording)
    parts = EncoderParts(stand_in[1].address, torch.float32, 4 << 20, cache_bytes=8 << 20, shm_dir=tmp_path)
    try:
        encoder.gate.set()
        encoder.rows = torch.ones(READ_ON_A_THREAD_BYTES // (4 * HIDDEN_SIZE) + 1, HIDDEN_SIZE)
        [large], _ = start_fetches(parts, [picture()])
        assert torch.equal(await fetched_rows(large), encoder.rows)
        encoder.rows = torch.ones(4, HIDDEN_SIZE)
        [small], _ = start_fetches(parts, [EncoderPrompt("image", b"another picture")])
        assert torch.equal(await fetched_rows(small), encoder.rows)
    finally:
        await parts.close()
    assert checked_on == [False, True]


def test_a_probe_made_before_its_segment_maps_failed_is_closed_not_leaked(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's file and descriptor (which holds its lock) were made first: a SegmentMaps that then
    raised (its sweeper's thread refused, its kernels' load) left both for the life of the process."""

    def refused(*_: object, **__: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(embed_replies.shm_segment_maps, "SegmentMaps", refused)
    num_fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError, match="can't start new thread"):
        EmbedReplies(torch.float32, HIDDEN_SIZE, 4 << 20, tmp_path)
    assert len(os.listdir("/proc/self/fd")) == num_fds
    assert list(tmp_path.iterdir()) == []  # its file too
