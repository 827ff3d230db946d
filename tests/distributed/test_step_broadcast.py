"""The step message on its own (no processes): a worker rebuilds exactly the batch rank 0 runs, and
writes its shard of every adapter rank 0 installs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from services.decoder.tests.models.helpers import PagedAllocator
from tandem.decoder.distributed.step_broadcast import END_WAIT_S, StepSender, receive_step
from tandem.decoder.engine.step.batch import StepBatch
from tandem.decoder.engine.step.rank_zero_failed import RankZeroFailed
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.loader import load_model
from tandem.decoder.models.lora import ROW_PARALLEL, LoraStep, LoraTable
from tandem.decoder.models.peft_adapter import TARGETS, LoraAdapter
from tandem.decoder.models.peft_weights import module_shapes

from .harness import FakeRank


class Recorder:
    """Stands in for the control group: rank 0's side records, a worker's side replays in order."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.within_s: list[float | None] = []  # how long rank 0 waits for each message at most

    def broadcast(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor:
        self.sent.append(x.clone())
        self.within_s.append(within_s)
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


def test_rank_0s_last_word_waits_a_bounded_time_and_abort_raises_rank_zero_failed() -> None:
    """A worker not on the feed (hung, inside a step, gone) would hold rank 0's shutdown for the group
    timeout, STOP's as ABORT's; steps, which every worker takes, wait as any collective does."""
    control = Recorder()
    sender = StepSender(control)  # type: ignore[arg-type]
    sender.keepalive()
    sender.stop()
    sender.abort()
    assert control.within_s == [None, END_WAIT_S, END_WAIT_S]
    control.sent.pop(1)  # the STOP, which would end the worker here
    with pytest.raises(RankZeroFailed, match="rank 0 failed"):
        receive_step(Replayer(control.sent), 8, torch.bfloat16, torch.device("cpu"))  # type: ignore[arg-type]


def test_only_embedding_rows_cross_as_floats() -> None:
    control = Recorder()
    StepSender(control).send(_batch(with_embeds=True))  # type: ignore[arg-type]
    floats = [t for t in control.sent if t.is_floating_point()]
    assert [tuple(t.shape) for t in floats] == [(3, 8)]  # the 3 embedding positions, not all 7 rows


def _adapter(config: ModelConfig, rank: int) -> LoraAdapter:
    """Random weights for every module of every layer but layer 0's k_proj and gate_proj."""
    gen = torch.Generator().manual_seed(5)
    weights = {}
    for layer in range(config.num_layers):
        for module, (out_features, in_features) in module_shapes(config).items():
            if layer == 0 and module in ("k_proj", "gate_proj"):
                continue
            a = torch.randn(rank, in_features, generator=gen)
            weights[(layer, module)] = (a, torch.randn(out_features, rank, generator=gen))
    return LoraAdapter(rank=rank, scale=0.75, targets=TARGETS, weights=weights)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_worker_writes_its_shard_of_each_adapter_and_gets_each_step_s_row_slots(
    rank: int, tiny_model_dir: Path
) -> None:
    config = load_model(tiny_model_dir, dtype="float32").config
    cpu = torch.device("cpu")
    whole = LoraTable(config, max_loras=2, max_rank=8, device=cpu)  # rank 0's of one rank
    adapter = _adapter(config, rank=6)
    whole.write(1, adapter)
    slots = torch.tensor([1, 1, 1, -1, -1, 1, 1])  # [7]
    control = Recorder()
    sender = StepSender(control)  # type: ignore[arg-type]
    sender.install_adapter(1, adapter)
    adapted = _batch(with_embeds=False)
    sender.send(
        dataclasses.replace(adapted, inputs=dataclasses.replace(adapted.inputs, lora=LoraStep(whole, slots)))
    )
    plain = _batch(with_embeds=False)
    sender.send(
        dataclasses.replace(plain, inputs=dataclasses.replace(plain.inputs, lora=LoraStep(whole, None)))
    )

    shard = LoraTable(config, max_loras=2, max_rank=8, device=cpu, tp=FakeRank(rank, 2))  # type: ignore[arg-type]
    replay = Replayer(control.sent)
    got = receive_step(replay, config.hidden_size, config.dtype, cpu, shard)  # type: ignore[arg-type]
    assert got is not None and got.inputs.lora is not None
    assert got.inputs.lora.table is shard and torch.equal(got.inputs.lora.slots, slots)
    got = receive_step(replay, config.hidden_size, config.dtype, cpu, shard)  # type: ignore[arg-type]
    assert got is not None and got.inputs.lora == LoraStep(shard, None)
    assert not replay.pending

    # The shard is the whole table's cut as the base projections are: row-parallel A by input
    # columns, column-parallel B by each part's output rows; the other halves whole.
    assert torch.equal(shard.scales, whole.scales)
    for mine, full in zip(shard.layers, whole.layers, strict=True):
        for name, p in mine.items():
            q = full[name]
            assert torch.equal(p.ranks, q.ranks)
            if name in ROW_PARALLEL:
                n = p.in_features
                assert 2 * n == q.in_features and torch.equal(p.bt, q.bt)
                assert torch.equal(p.a, q.a[:, :, rank * n : (rank + 1) * n])
                continue
            assert torch.equal(p.a, q.a) and p.out_features * 2 == q.out_features
            for lo, hi, full_lo in zip((0, *p.part_ends), p.part_ends, (0, *q.part_ends), strict=False):
                n = hi - lo
                want = q.bt[:, :, full_lo + rank * n : full_lo + (rank + 1) * n]
                assert torch.equal(p.bt[:, :, lo:hi], want), name
    assert shard.layers[0]["qkv_proj"].ranks[1].tolist() == [6, 0, 6]  # k_proj left alone in layer 0
