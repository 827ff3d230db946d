"""Qwen3 and Llama against the transformers models that saved the checkpoints, and against themselves
(packed vs alone, batched decode vs alone, chunked vs whole prefill)."""

from __future__ import annotations

import torch

from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.loader import load_model

from ..conftest import Checkpoint
from .helpers import PagedRun, greedy, greedy_batch, hf_greedy

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 1000, 3, 88]
PROMPTS = [PROMPT, [901, 2, 45], [7], list(range(100, 160, 3))]


def test_prompt_logits_match_transformers(checkpoint: Checkpoint) -> None:
    model = load_model(checkpoint.path, dtype="float32").model
    logits = PagedRun(model).step([("s", PROMPT)], all_logits=True)
    with torch.no_grad():
        ref = checkpoint.hf_model(torch.tensor([PROMPT])).logits[0].float()
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_greedy_decoding_through_the_paged_cache_matches_transformers_generate(
    checkpoint: Checkpoint,
) -> None:
    model = load_model(checkpoint.path, dtype="float32").model
    # Block size 4: the 13-token prompt and its 32 continuations span twelve blocks.
    assert greedy(model, PROMPT, 32, block_size=4) == hf_greedy(checkpoint.hf_model, PROMPT, 32)


def test_bfloat16_greedy_tokens_match_transformers_in_bfloat16(checkpoint: Checkpoint) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    hf_bf16 = type(checkpoint.hf_model)(checkpoint.hf_model.config).train(False)
    hf_bf16.load_state_dict(checkpoint.hf_model.state_dict())
    assert greedy(model, PROMPT, 8) == hf_greedy(hf_bf16.to(torch.bfloat16), PROMPT, 8)


def test_sequences_packed_in_one_prefill_equal_each_run_alone(checkpoint: Checkpoint) -> None:
    model = load_model(checkpoint.path, dtype="float32").model
    packed = PagedRun(model).step(list(enumerate(PROMPTS)), all_logits=True)
    alone = torch.cat([PagedRun(model).step([(0, p)], all_logits=True) for p in PROMPTS])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_decode_batch_of_several_sequences_equals_each_decoded_alone(checkpoint: Checkpoint) -> None:
    model = load_model(checkpoint.path, dtype="float32").model
    assert greedy_batch(model, PROMPTS, 12) == [greedy(model, p, 12) for p in PROMPTS]


def test_mixed_prefill_and_decode_step_equals_separate_steps(qwen3_fp32: torch.nn.Module) -> None:
    mixed = PagedRun(qwen3_fp32)
    mixed.step([("a", PROMPT)])
    logits = mixed.step([("a", [42]), ("b", PROMPTS[1])])  # a decodes while b prefills
    a_alone = PagedRun(qwen3_fp32)
    a_alone.step([("a", PROMPT)])
    expected = torch.cat((a_alone.step([("a", [42])]), PagedRun(qwen3_fp32).step([("b", PROMPTS[1])])))
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_prompt_prefilled_in_two_chunks_equals_one_prefill(checkpoint: Checkpoint) -> None:
    model = load_model(checkpoint.path, dtype="float32").model
    whole = PagedRun(model).step([("s", PROMPT)], all_logits=True)
    chunked = PagedRun(model)
    # The split falls mid-block (block size 4), so the second chunk appends to a partly filled block.
    first = chunked.step([("s", PROMPT[:6])], all_logits=True)
    second = chunked.step([("s", PROMPT[6:])], all_logits=True)
    torch.testing.assert_close(torch.cat((first, second)), whole, atol=1e-5, rtol=1e-5)


def test_logits_are_returned_only_at_logits_indices(qwen3_fp32: torch.nn.Module) -> None:
    run = PagedRun(qwen3_fp32)
    logits = run.step([(0, PROMPTS[0]), (1, PROMPTS[1])])
    assert logits.shape == (2, qwen3_fp32.config.vocab_size) and logits.dtype == torch.float32


def test_int64_positions_give_the_same_logits_as_int32(qwen3_fp32: torch.nn.Module) -> None:
    run32, run64 = PagedRun(qwen3_fp32), PagedRun(qwen3_fp32)
    attn32 = run32.allocator.metadata([("s", len(PROMPT))])
    attn64 = run64.allocator.metadata([("s", len(PROMPT))])
    ids = torch.tensor(PROMPT, dtype=torch.int32)
    positions = torch.arange(len(PROMPT))
    logits32 = qwen3_fp32(ForwardBatch(ids, positions.int(), attn32), run32.kv_caches)
    logits64 = qwen3_fp32(ForwardBatch(ids, positions, attn64), run64.kv_caches)
    assert torch.equal(logits32, logits64)
