"""The encoder's shared-memory replies: taken only on a proof, bounded, freed by their reader or their
lease, and the same rows as the bytes they replace."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tandem.client.pb.tandem.v1 import encoder_pb2, tensor_pb2
from tandem.common import shared_memory, tensors
from tandem.encoder.config import EncoderConfig
from tandem.encoder.loader import load_embedder
from tandem.encoder.servicer import EncoderServicer
from tandem.encoder.shared_segments import SharedSegments


def _offer(probe: shared_memory.Probe) -> encoder_pb2.SharedMemoryOffer:
    return encoder_pb2.SharedMemoryOffer(
        probe_name=probe.name,
        probe_token=probe.token,
        segment_name=shared_memory.new_name(shared_memory.SEGMENT_PREFIX),
        digest_key=os.urandom(shared_memory.KEY_BYTES),
    )


@pytest.fixture
def probe(tmp_path: Path):
    made = shared_memory.Probe.create(tmp_path)
    assert made is not None
    yield made
    made.close()


@pytest.fixture
def segments(tmp_path: Path):
    made = SharedSegments(tmp_path, max_bytes=1000, max_segments=3, lease_s=0.4)
    yield made
    made.close()


def _read(directory: Path, handle: tensor_pb2.SharedTensor, key: bytes) -> torch.Tensor:
    segment = shared_memory.open_segment(directory, handle.name)
    assert segment is not None
    return tensors.decode_shared(handle, segment, key, rank=2).clone()


def test_an_offer_is_taken_only_with_its_proof(tmp_path: Path, probe, segments: SharedSegments) -> None:
    offer = _offer(probe)
    assert segments.target(offer) is not None
    for change in (
        lambda o: setattr(o, "probe_token", os.urandom(shared_memory.TOKEN_BYTES)),
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


def test_the_rows_written_are_the_rows_read_cast_as_asked(tmp_path: Path, probe, segments) -> None:
    offer = _offer(probe)
    rows = torch.randn(4, 16)
    handle = segments.target(offer).write(rows, torch.bfloat16)
    assert handle is not None and handle.name == offer.segment_name and handle.lease_s == 0.4
    assert torch.equal(_read(tmp_path, handle, offer.digest_key), rows.bfloat16())


def test_beyond_its_bytes_or_segments_a_reply_carries_bytes(probe, segments: SharedSegments) -> None:
    assert segments.target(_offer(probe)).write(torch.zeros(1, 251), None) is None  # 1004 > 1000 bytes
    for _ in range(3):
        assert segments.target(_offer(probe)).write(torch.zeros(1, 2), None) is not None
    assert segments.target(_offer(probe)).write(torch.zeros(1, 2), None) is None  # a 4th segment
    assert segments.num_live == 3


def test_a_name_already_there_is_never_written_over(tmp_path: Path, probe, segments) -> None:
    offer = _offer(probe)
    (tmp_path / offer.segment_name).write_bytes(b"someone else's")
    assert segments.target(offer).write(torch.zeros(1, 2), None) is None
    assert (tmp_path / offer.segment_name).read_bytes() == b"someone else's"


def test_a_segment_its_reader_removed_frees_its_share(tmp_path: Path, probe, segments) -> None:
    for _ in range(3):
        handle = segments.target(_offer(probe)).write(torch.zeros(1, 2), None)
    shared_memory.remove(tmp_path, handle.name)  # what the reader does once it has read it
    assert segments.target(_offer(probe)).write(torch.zeros(1, 2), None) is not None
    assert segments.num_expired == 0


def test_an_unread_segment_is_removed_when_its_lease_runs_out(tmp_path: Path, probe, segments) -> None:
    offer = _offer(probe)
    handle = segments.target(offer).write(torch.zeros(2, 2), None)
    assert shared_memory.exists(tmp_path, handle.name)
    deadline = time.monotonic() + 5
    while shared_memory.exists(tmp_path, handle.name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not shared_memory.exists(tmp_path, handle.name)  # the sweeper's, with no call to trigger it
    assert segments.num_live == 0 and segments.num_expired == 1
    assert shared_memory.open_segment(tmp_path, handle.name) is None  # a replay finds nothing


def test_closing_removes_every_segment(tmp_path: Path, probe) -> None:
    segments = SharedSegments(tmp_path, 1000, 3, 60.0)
    names = [segments.target(_offer(probe)).write(torch.zeros(1, 2), None).name for _ in range(2)]
    segments.close()
    assert not any(shared_memory.exists(tmp_path, name) for name in names)


async def test_an_embed_with_a_proven_offer_replies_with_a_handle_not_bytes(
    tiny_model: Path, tmp_path: Path, probe
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
        rows = _read(tmp_path, shared.shared_embeddings, offer.digest_key)
        assert torch.equal(rows, tensors.decode(plain.embeddings))
        offer.probe_token = os.urandom(shared_memory.TOKEN_BYTES)  # no proof: bytes, as before
        unproven = await servicer.Embed(
            encoder_pb2.EmbedRequest(text="hello there", shared_memory=offer), None
        )
        assert unproven.embeddings == plain.embeddings and not unproven.HasField("shared_embeddings")
    finally:
        servicer.close()
