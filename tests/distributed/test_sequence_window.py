"""Sequence-parallel slicing on its own (no processes): each rank's window of the per-position inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.decoder.tests.models.helpers import PagedAllocator
from tandem.decoder.engine.scheduling.kv_cache import NULL_BLOCK_ID
from tandem.decoder.engine.step.batch import StepBatch
from tandem.decoder.engine.step.sequence_parallel import pad_for_sequence_parallel
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.layers import merge_prompt_embeds
from tandem.decoder.models.loader import ModelLoadError, load_model
from tandem.decoder.models.lora import LoraStep, LoraTable
from tandem.decoder.models.tensor_parallel import local_rows

from .harness import FakeRank


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_windows_are_the_global_inputs_cut_at_rank_times_local_len(world_size: int) -> None:
    num_tokens = 12
    gen = torch.Generator().manual_seed(0)
    inputs_embeds = torch.randn(num_tokens, 8, generator=gen)  # [num_tokens, hidden]
    is_token_ids = torch.rand(num_tokens, generator=gen) > 0.5  # [num_tokens]
    local_len = num_tokens // world_size
    for rank in range(world_size):
        tp = FakeRank(rank, world_size)
        window = slice(rank * local_len, (rank + 1) * local_len)
        assert torch.equal(local_rows(inputs_embeds, tp, sp=True), inputs_embeds[window])
        assert torch.equal(local_rows(is_token_ids, tp, sp=True), is_token_ids[window])
        assert local_rows(inputs_embeds, tp, sp=False) is inputs_embeds  # decode: no slicing


def test_merging_each_window_then_concatenating_equals_the_global_merge() -> None:
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(10, 8, generator=gen)
    inputs_embeds = torch.randn(10, 8, generator=gen)
    is_token_ids = torch.tensor([True, False] * 5)
    windows = []
    for rank in range(2):
        tp = FakeRank(rank, 2)
        h_local = h[rank * 5 : (rank + 1) * 5]
        embeds_local, is_token_local = local_rows(inputs_embeds, tp, True), local_rows(is_token_ids, tp, True)
        windows.append(merge_prompt_embeds(h_local, embeds_local, is_token_local))
    assert torch.equal(torch.cat(windows), merge_prompt_embeds(h, inputs_embeds, is_token_ids))


def _batch(query_lens: list[int], with_embeds: bool, lora: LoraStep | None = None) -> StepBatch:
    alloc = PagedAllocator(num_blocks=32, block_size=4)
    attn = alloc.metadata([(i, n) for i, n in enumerate(query_lens)])
    num_tokens = sum(query_lens)
    inputs = ForwardBatch(
        input_ids=torch.arange(1, num_tokens + 1, dtype=torch.int32),
        positions=torch.arange(num_tokens),
        attn=attn,
        inputs_embeds=torch.ones(num_tokens, 8) if with_embeds else None,
        is_token_ids=torch.zeros(num_tokens, dtype=torch.bool) if with_embeds else None,
        lora=lora,
    )
    return StepBatch(inputs, num_logits=len(query_lens))


def test_prefill_is_padded_to_a_multiple_of_the_world_size_with_null_block_tokens() -> None:
    step = _batch([3, 4], with_embeds=True)  # 7 tokens
    padded_step = pad_for_sequence_parallel(step, 4)
    assert padded_step.num_logits == step.num_logits
    batch, padded = step.inputs, padded_step.inputs
    assert padded.input_ids.shape[0] == 8
    assert padded.input_ids[7] == 0 and padded.positions[7] == 0
    assert padded.attn.slot_mapping[7] == NULL_BLOCK_ID * 4  # the reserved null block
    assert padded.is_token_ids is not None and bool(padded.is_token_ids[7])
    assert padded.inputs_embeds is not None and padded.inputs_embeds[7].abs().sum() == 0
    # The sequences and the rows that sample are the unpadded batch's.
    assert padded.attn.query_lens == [3, 4]
    assert torch.equal(padded.attn.logits_indices, batch.attn.logits_indices)
    assert torch.equal(padded.input_ids[:7], batch.input_ids)


def test_padding_rows_run_the_base_model_and_the_table_stays_the_steps(
    hf_checkpoint_dirs: dict[str, Path],
) -> None:
    config = load_model(hf_checkpoint_dirs["llama3"], dtype="float32").config
    table = LoraTable(config, max_loras=2, max_rank=4, device=torch.device("cpu"))
    slots = torch.tensor([0, 0, 0, -1, 1, 1, 1])  # [7]: one row per token of the two sequences
    padded = pad_for_sequence_parallel(_batch([3, 4], False, LoraStep(table, slots)), 4).inputs.lora
    assert padded is not None and padded.table is table and padded.slots is not None
    assert padded.slots.tolist() == [0, 0, 0, -1, 1, 1, 1, -1]
    no_row_adapted = pad_for_sequence_parallel(_batch([3, 4], False, LoraStep(table, None)), 4).inputs.lora
    assert no_row_adapted == LoraStep(table, None)


def test_decode_only_and_already_divisible_steps_are_not_padded() -> None:
    decode = _batch([1, 1, 1], with_embeds=False)
    assert pad_for_sequence_parallel(decode, 2) is decode
    even = _batch([3, 3], with_embeds=False)
    assert pad_for_sequence_parallel(even, 2) is even


def test_kv_heads_that_do_not_divide_over_the_ranks_fail_clearly(hf_checkpoint_dirs: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match=r"num_kv_heads \(1\) must be divisible by the world size \(2\)"):
        load_model(hf_checkpoint_dirs["llama3"], dtype="float32", tp=FakeRank(0, 2))  # type: ignore[arg-type]
