"""The step message on its own (no processes): a worker rebuilds exactly the batch rank 0 runs."""

from __future__ import annotations

import torch

from services.decoder.tests.models.helpers import PagedAllocator
from tandem.decoder.distributed.step_broadcast import StepSender, receive_step
from tandem.decoder.engine.step.batch import StepBatch
from tandem.decoder.models.forward_batch import ForwardBatch


class Recorder:
    """Stands in for the control group: rank 0's side records, a worker's side replays in order."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        self.sent.append(x.clone())
        return x


class Replayer:
    def __init__(self, sent: list[torch.Tensor]) -> None:
        self.pending = list(sent)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        message = self.pending.pop(0)
        assert message.shape == x.shape and message.dtype == x.dtype
        return x.copy_(message)


def _batch(with_embeds: bool) -> StepBatch:
    attn = PagedAllocator(num_blocks=32, block_size=4).metadata([("a", 5), ("b", 2)])
    inputs_embeds = is_token_ids = None
    if with_embeds:
        is_token_ids = torch.tensor([True, False, False, True, True, True, False])
        inputs_embeds = torch.randn(7, 8, dtype=torch.bfloat16) * (~is_token_ids)[:, None]
    inputs = ForwardBatch(
        input_ids=torch.tensor([4, 0, 0, 7, 8, 9, 0], dtype=torch.int32),
        positions=torch.tensor([0, 1, 2, 3, 4, 0, 1]),
        attn=attn,
        inputs_embeds=inputs_embeds,
        is_token_ids=is_token_ids,
    )
    return StepBatch(inputs, num_logits=2)


def _assert_same(got_step: StepBatch, want_step: StepBatch) -> None:
    got, want = got_step.inputs, want_step.inputs
    for name in ("input_ids", "positions", "is_token_ids", "inputs_embeds"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if b is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("seq_lens_t", "slot_mapping", "block_tables", "logits_indices"):
        a, b = getattr(got.attn, name), getattr(want.attn, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.attn.query_lens == want.attn.query_lens and got.attn.seq_lens == want.attn.seq_lens
    assert got.lora is None and got_step.scored_spans == ()
    assert got_step.num_logits == want_step.num_logits


def test_worker_rebuilds_token_and_embedding_batches_between_keepalives_and_stops_on_stop() -> None:
    control = Recorder()
    sender = StepSender(control)  # type: ignore[arg-type]
    batches = [_batch(with_embeds=True), _batch(with_embeds=False)]
    sender.keepalive()
    sender.send(batches[0])
    sender.keepalive()
    sender.send(batches[1])
    sender.stop()
    replay = Replayer(control.sent)
    for want in batches:
        got = receive_step(replay, 8, torch.bfloat16, torch.device("cpu"))  # type: ignore[arg-type]
        assert got is not None
        _assert_same(got, want)
    assert receive_step(replay, 8, torch.bfloat16, torch.device("cpu")) is None  # type: ignore[arg-type]
    assert not replay.pending


def test_only_embedding_rows_cross_as_floats() -> None:
    control = Recorder()
    StepSender(control).send(_batch(with_embeds=True))  # type: ignore[arg-type]
    floats = [t for t in control.sent if t.is_floating_point()]
    assert [tuple(t.shape) for t in floats] == [(3, 8)]  # the 3 embedding positions, not all 7 rows
