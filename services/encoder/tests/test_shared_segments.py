"""The encoder's shared-memory replies: taken only on a proof, written into a pool of segments used
again once their reader released them or their lease ran out and never before, bounded, and the same
rows as the bytes they replace."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import encoder_pb2, tensor_pb2
from tandem.common.torch_part import shared_memory, shm_digest, shm_probe, shm_segment_maps, tensors
from tandem.encoder.config import EncoderConfig
from tandem.encoder.loader import load_embedder
from tandem.encoder.servicer import EncoderServicer
from tandem.encoder.shared_segments import SharedSegments


def _offer(probe: shm_probe.Probe) -> encoder_pb2.SharedMemoryOffer:
    return encoder_pb2.SharedMemoryOffer(
        probe_name=probe.name,
        probe_token=probe.token,
        segment_name=shared_memory.new_name(shared_memory.SEGMENT_PREFIX),
        digest_key=os.urandom(shm_digest.KEY_BYTES),
    )


@pytest.fixture
def probe(tmp_path: Path):
    made = shm_probe.Probe.create(tmp_path)
    assert made is not None
    yield made
    made.close()


@pytest.fixture
def reader(tmp_path: Path):
    """The decoder's side: its mappings of the segments it is given."""
    made = shm_segment_maps.SegmentMaps(tmp_path)
    yield made
    made.close()


@pytest.fixture
def segments(tmp_path: Path):
    made = SharedSegments(tmp_path, max_bytes=1000, max_segments=3, lease_s=0.4)
    yield made
    made.close()


def _read(reader: shm_segment_maps.SegmentMaps, handle: tensor_pb2.SharedTensor, key: bytes) -> torch.Tensor:
    segment = reader.open(handle.name)
    assert segment is not None
    with segment:
        return tensors.decode_shared(handle, segment, key, rank=2)


def _release(directory: Path, handle: tensor_pb2.SharedTensor) -> None:
    """What the reader does once it has copied the rows."""
    assert shared_memory.remove(directory, handle.name)


def _file(directory: Path, handle: tensor_pb2.SharedTensor) -> int:
    """The segment a handle's name stands for: its file's inode."""
    return os.stat(directory / handle.name).st_ino


def _written(segments: SharedSegments, probe, rows: torch.Tensor):
    offer = _offer(probe)
    handle = segments.target(offer).write(rows, None)
    return handle, offer.digest_key


def test_an_offer_is_taken_only_with_its_proof(tmp_path: Path, probe, segments: SharedSegments) -> None:
    offer = _offer(probe)
    assert segments.target(offer) is not None
    for change in (
        lambda o: setattr(o, "probe_token", os.urandom(shm_probe.TOKEN_BYTES)),
        lambda o: setattr(o, "probe_name", shared_memory.new_name(shared_memory.PROBE_PREFIX)),
        lambda o: setattr(o, "segment_name", "../" + o.segment_name),
        lambda o: setattr(o, "segment_name", probe.name),  # a name of another kind
        lambda o: setattr(o, "digest_key", b"short"),
    ):
        forged = encoder_pb2.SharedMemoryOffer()
        forged.CopyFrom(offer)
        change(forged)
        assert segments.target(forged) is None
    elsewhere = SharedSegments(tmp_path / "other-host", 1000, 3, 0.4)  # its /dev/shm lacks the probe
    try:
        assert elsewhere.target(offer) is None
    finally:
        elsewhere.close()


def test_the_rows_written_are_the_rows_read_cast_as_asked(tmp_path: Path, probe, segments, reader) -> None:
    offer = _offer(probe)
    rows = torch.randn(4, 16)
    handle = segments.target(offer).write(rows, torch.bfloat16)
    assert handle is not None and handle.name == offer.segment_name and handle.lease_s == 0.4
    assert torch.equal(_read(reader, handle, offer.digest_key), rows.bfloat16())


def test_rows_written_straight_into_a_segment_are_digested_where_they_lie(
    tmp_path: Path, probe, segments, reader
) -> None:
    offer, rows = _offer(probe), torch.randn(3, 8)

    def fill(out: torch.Tensor) -> None:
        assert out.shape == (3, 8) and out.dtype == torch.float32
        out.copy_(rows)

    handle = segments.target(offer).write_with([3, 8], torch.float32, fill)
    assert handle is not None and list(handle.shape) == [3, 8]
    assert (tmp_path / handle.name).read_bytes()[: rows.numel() * 4] == rows.numpy().tobytes()
    assert torch.equal(_read(reader, handle, offer.digest_key), rows)


def test_a_fill_that_fails_gives_its_segment_and_name_back_and_the_pool_still_closes(
    tmp_path: Path, probe, segments
) -> None:
    offer = _offer(probe)

    def fill(out: torch.Tensor) -> None:
        raise RuntimeError("the embedder failed")

    with pytest.raises(RuntimeError, match="the embedder failed") as failed:
        segments.target(offer).write_with([2, 8], torch.float32, fill)
    assert not (tmp_path / offer.segment_name).exists() and segments.num_leased == 0
    assert _written(segments, probe, torch.zeros(2, 8))[0] is not None and segments.num_created == 1
    # The failure's traceback, alive here, held the view of the mapping: closing it raised BufferError.
    segments.close()
    assert failed.value.__traceback__ is not None
    assert not list(tmp_path.glob(shared_memory.POOL_PREFIX + "*"))


def test_beyond_its_bytes_or_segments_a_reply_carries_bytes(probe, segments: SharedSegments) -> None:
    assert segments.target(_offer(probe)).write(torch.zeros(1, 251), None) is None  # 1004 > 1000 bytes
    for _ in range(3):
        assert segments.target(_offer(probe)).write(torch.zeros(1, 2), None) is not None
    assert segments.target(_offer(probe)).write(torch.zeros(1, 2), None) is None  # a 4th segment
    assert segments.num_leased == 3 and segments.num_segments == 3


def test_a_name_already_there_is_never_written_over(tmp_path: Path, probe, segments) -> None:
    offer = _offer(probe)
    (tmp_path / offer.segment_name).write_bytes(b"someone else's")
    assert segments.target(offer).write(torch.zeros(1, 2), None) is None
    assert (tmp_path / offer.segment_name).read_bytes() == b"someone else's"
    assert segments.num_leased == 0  # and the segment it would have had is free


def test_a_segment_its_reader_released_is_written_again_for_the_next_call(
    tmp_path: Path, probe, segments, reader
) -> None:
    first, first_key = _written(segments, probe, torch.randn(2, 8))
    used = _file(tmp_path, first)
    _read(reader, first, first_key)
    _release(tmp_path, first)
    rows = torch.randn(2, 8)
    second, second_key = _written(segments, probe, rows)
    assert _file(tmp_path, second) == used and second.name != first.name
    assert torch.equal(_read(reader, second, second_key), rows)
    assert (segments.num_written, segments.num_created, segments.num_expired) == (2, 1, 0)
    assert reader.num_mapped == 1  # the reader's mapping of that segment, kept from the first call


def test_a_segment_is_never_written_again_while_leased(tmp_path: Path, probe, segments, reader) -> None:
    rows = torch.randn(2, 8)
    leased, key = _written(segments, probe, rows)
    other, _ = _written(segments, probe, torch.randn(2, 8))
    assert _file(tmp_path, other) != _file(tmp_path, leased)
    assert torch.equal(_read(reader, leased, key), rows)  # untouched by the call after it
    assert segments.num_created == 2


def test_a_call_takes_the_smallest_free_segment_that_holds_its_rows(tmp_path: Path, probe) -> None:
    segments = SharedSegments(tmp_path, max_bytes=1 << 20, max_segments=8, lease_s=5.0)
    try:
        small, _ = _written(segments, probe, torch.zeros(1, 16))  # 64 bytes
        large, _ = _written(segments, probe, torch.zeros(1, 1024))  # 4 KiB
        small_file, large_file = _file(tmp_path, small), _file(tmp_path, large)
        _release(tmp_path, small)
        _release(tmp_path, large)
        assert _file(tmp_path, _written(segments, probe, torch.zeros(1, 10))[0]) == small_file
        assert _file(tmp_path, _written(segments, probe, torch.zeros(1, 20))[0]) == large_file  # 80 > 64
        assert segments.num_created == 2
    finally:
        segments.close()


def test_a_full_pool_gives_back_free_segments_too_small_to_make_room(tmp_path: Path, probe, reader) -> None:
    segments = SharedSegments(tmp_path, max_bytes=1000, max_segments=2, lease_s=5.0)
    try:
        for handle in [_written(segments, probe, torch.zeros(1, 2))[0] for _ in range(2)]:
            _release(tmp_path, handle)
        assert segments.num_segments == 2
        rows = torch.randn(1, 200)  # 800 bytes: neither fits, and two segments is the bound
        handle, key = _written(segments, probe, rows)
        assert handle is not None and torch.equal(_read(reader, handle, key), rows)
        assert segments.num_segments == 1 and segments.num_created == 3
    finally:
        segments.close()


def test_an_exhausted_pool_answers_bytes_at_once_until_a_reader_releases(tmp_path: Path, probe) -> None:
    segments = SharedSegments(tmp_path, max_bytes=1000, max_segments=1, lease_s=60.0)
    try:
        leased, _ = _written(segments, probe, torch.zeros(1, 2))
        assert segments.target(_offer(probe)).write(torch.zeros(1, 2), None) is None  # bytes, no wait
        _release(tmp_path, leased)
        assert segments.target(_offer(probe)).write(torch.zeros(1, 2), None) is not None
    finally:
        segments.close()


def test_the_old_handle_of_a_segment_written_again_is_refused(
    tmp_path: Path, probe, segments, reader
) -> None:
    old, old_key = _written(segments, probe, torch.randn(2, 8))
    _read(reader, old, old_key)
    _release(tmp_path, old)
    new, _ = _written(segments, probe, torch.randn(2, 8))
    assert reader.open(old.name) is None  # its name went with its read
    replayed = tensor_pb2.SharedTensor()
    replayed.CopyFrom(old)
    replayed.name = new.name  # the old handle under the new call's name: the bytes are not its own
    with pytest.raises(InvalidArgument, match=r"tensor\.digest: does not match"):
        _read(reader, replayed, old_key)


def test_an_unread_lease_runs_out_its_name_removed_and_its_segment_freed(
    tmp_path: Path, probe, segments, reader
) -> None:
    handle, key = _written(segments, probe, torch.zeros(2, 2))
    used = _file(tmp_path, handle)
    late = reader.open(handle.name)  # a reader that opened it, and then stalled
    deadline = time.monotonic() + 5
    while shared_memory.exists(tmp_path, handle.name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not shared_memory.exists(tmp_path, handle.name)  # the sweeper's, with no call to trigger it
    assert segments.num_leased == 0 and segments.num_expired == 1
    assert reader.open(handle.name) is None  # a replay finds nothing
    next_handle, _ = _written(segments, probe, torch.ones(2, 2))
    assert _file(tmp_path, next_handle) == used  # free again, and written again
    with late, pytest.raises(InvalidArgument, match=r"tensor\.digest"):  # the late reader: never these rows
        tensors.decode_shared(handle, late, key)


def test_a_segment_whose_call_was_cancelled_is_freed_at_once_not_after_its_lease(
    tmp_path: Path, probe, segments
) -> None:
    target = segments.target(_offer(probe))
    handle = target.write(torch.zeros(2, 2), None)  # written, the reply never sent
    used = _file(tmp_path, handle)
    segments.abandon(target)
    assert not shared_memory.exists(tmp_path, handle.name) and segments.num_leased == 0
    assert segments.num_expired == 0  # not its lease: it had 0.4 s of it left
    assert _file(tmp_path, _written(segments, probe, torch.ones(2, 2))[0]) == used  # free for the next call


def test_a_call_cancelled_before_its_batch_wrote_it_is_never_linked(tmp_path: Path, probe, segments) -> None:
    early, during = _offer(probe), _offer(probe)
    target = segments.target(early)
    segments.abandon(target)  # cancelled while queued
    assert target.write_with([2, 2], torch.float32, lambda out: None) is None
    assert target.write(torch.zeros(2, 2), None) is None  # the batch's second try, rows copied, too
    # Cancelled while its rows were being written: the write gives its segment back as it ends.
    during_target = segments.target(during)
    handle = during_target.write_with([2, 2], torch.float32, lambda out: segments.abandon(during_target))
    assert handle is None
    assert not shared_memory.exists(tmp_path, early.segment_name)
    assert not shared_memory.exists(tmp_path, during.segment_name)
    assert segments.num_leased == 0 and segments.num_written == 1


def test_a_cancelled_call_that_offered_another_calls_name_frees_nothing_of_that_call(
    tmp_path: Path, probe, segments, reader
) -> None:
    rows = torch.randn(2, 2)
    victim = _offer(probe)
    replay = _offer(probe)
    replay.segment_name = victim.segment_name  # a name seen in /dev/shm, with its own valid proof
    # Cancelled before the victim's batch wrote it: the victim's call is still linked.
    segments.abandon(segments.target(replay))
    handle = segments.target(victim).write(rows, None)
    assert handle is not None
    # Cancelled after it, its own link of the name refused (the bytes went in its reply), even with the
    # victim's key too: the victim's lease holds, its rows unread in it.
    for key in (replay.digest_key, victim.digest_key):
        replay.digest_key = key
        target = segments.target(replay)
        assert target.write(torch.zeros(2, 2), None) is None
        segments.abandon(target)
    assert shared_memory.exists(tmp_path, handle.name) and segments.num_leased == 1
    assert torch.equal(_read(reader, handle, victim.digest_key), rows)


def test_a_segment_written_again_holds_nothing_of_the_longer_rows_before_past_its_own(
    tmp_path: Path, probe, segments
) -> None:
    first, _ = _written(segments, probe, torch.randn(2, 32) + 10)  # 256 bytes, none of them zero
    _release(tmp_path, first)
    second, _ = _written(segments, probe, torch.ones(1, 2))  # 8 bytes, in the same 256-byte segment
    lying = (tmp_path / second.name).read_bytes()  # all a reader of the name can map
    assert len(lying) == 256 and lying[8:] == bytes(248)
    assert lying[:8] == torch.ones(2).numpy().tobytes()


def test_a_segment_free_for_its_idle_time_is_given_back(tmp_path: Path, probe) -> None:
    segments = SharedSegments(tmp_path, max_bytes=1000, max_segments=3, lease_s=0.4, idle_s=0.2)
    try:
        _release(tmp_path, _written(segments, probe, torch.zeros(1, 2))[0])
        deadline = time.monotonic() + 5
        while segments.num_segments and time.monotonic() < deadline:
            time.sleep(0.05)
        assert segments.num_segments == 0
        assert not list(tmp_path.glob(shared_memory.POOL_PREFIX + "*"))
    finally:
        segments.close()


def test_closing_removes_every_segment_and_every_name(tmp_path: Path, probe) -> None:
    segments = SharedSegments(tmp_path, 1000, 3, 60.0)
    names = [segments.target(_offer(probe)).write(torch.zeros(1, 2), None).name for _ in range(2)]
    _release(tmp_path, _written(segments, probe, torch.zeros(1, 2))[0])  # a free one too
    segments.close()
    assert not any(shared_memory.exists(tmp_path, name) for name in names)
    assert not list(tmp_path.glob(shared_memory.POOL_PREFIX + "*"))


def test_a_new_pool_removes_what_a_killed_encoder_left_and_not_a_live_ones(tmp_path: Path, probe) -> None:
    live = SharedSegments(tmp_path, 1000, 3, 60.0)
    try:
        _release(tmp_path, _written(live, probe, torch.zeros(1, 2))[0])
        killed = shared_memory.new_name(shared_memory.POOL_PREFIX)  # a pool whose encoder died
        (tmp_path / killed).write_bytes(bytes(8))
        starting = SharedSegments(tmp_path, 1000, 3, 60.0)
        starting.close()
        assert starting.num_abandoned == 1 and not (tmp_path / killed).exists()
        assert live.num_segments == 1 and len(list(tmp_path.glob(shared_memory.POOL_PREFIX + "*"))) == 1
        assert _written(live, probe, torch.zeros(1, 2))[0] is not None  # and it serves on
    finally:
        live.close()


async def test_an_embed_with_a_proven_offer_replies_with_a_handle_not_bytes(
    tiny_model: Path, tmp_path: Path, probe, reader
) -> None:
    config = EncoderConfig(model_dir=tiny_model, shared_memory_dir=tmp_path)
    servicer = EncoderServicer(config)
    servicer.attach(load_embedder(config))
    try:
        plain = await servicer.Embed(encoder_pb2.EmbedRequest(text="hello there"), None)
        offer = _offer(probe)
        shared = await servicer.Embed(encoder_pb2.EmbedRequest(text="hello there", shared_memory=offer), None)
        assert shared.HasField("shared_embeddings") and not shared.HasField("embeddings")
        assert shared.ByteSize() < plain.ByteSize() - plain.embeddings.ByteSize() + 200
        rows = _read(reader, shared.shared_embeddings, offer.digest_key)
        assert torch.equal(rows, tensors.decode(plain.embeddings))
        offer.probe_token = os.urandom(shm_probe.TOKEN_BYTES)  # no proof: bytes, as before
        unproven = await servicer.Embed(
            encoder_pb2.EmbedRequest(text="hello there", shared_memory=offer), None
        )
        assert unproven.embeddings == plain.embeddings and not unproven.HasField("shared_embeddings")
    finally:
        servicer.close()


class _EndedCall:
    """A served call's context, ended when the test says: its done callbacks run then."""

    def __init__(self, cancelled: bool) -> None:
        self.callbacks: list = []
        self.was_cancelled = cancelled

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def cancelled(self) -> bool:
        return self.was_cancelled

    def end(self) -> None:
        for callback in self.callbacks:
            callback(self)


async def test_an_embed_cancelled_after_its_rows_were_written_gives_its_segment_back_at_once(
    tiny_model: Path, tmp_path: Path, probe
) -> None:
    # The decoder removes the name it asked for when its call is cancelled, but the batch may link it
    # after that: 40 cancelled Generates held 2 of 8 segments for the 10 s lease.
    config = EncoderConfig(model_dir=tiny_model, shared_memory_dir=tmp_path)
    servicer = EncoderServicer(config)
    servicer.attach(load_embedder(config))
    assert servicer.segments is not None
    try:
        names = {}
        for was_cancelled in (False, True):
            call = _EndedCall(was_cancelled)
            request = encoder_pb2.EmbedRequest(text="hi", shared_memory=_offer(probe))
            names[was_cancelled] = (await servicer.Embed(request, call)).shared_embeddings.name
            call.end()
        assert shared_memory.exists(tmp_path, names[False])  # a reply delivered: its reader's to release
        assert not shared_memory.exists(tmp_path, names[True])
        assert servicer.segments.num_leased == 1 and servicer.segments.num_expired == 0
    finally:
        servicer.close()
