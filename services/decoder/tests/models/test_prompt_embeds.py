"""Prompts mixing token IDs and embedding rows: [tokens A, embeddings E, tokens B]."""

from __future__ import annotations

import pytest
import torch

from tandem.decoder.models.loader import load_model
from tandem.decoder.models.transformer import DecoderModel

from ..conftest import Checkpoint
from .helpers import PagedRun

TOKENS_A, EMBEDDED, TOKENS_B = [17, 402, 33], [981, 5, 250, 731], [64, 12]
PROMPT = TOKENS_A + EMBEDDED + TOKENS_B
IS_TOKEN_IDS = torch.tensor([True] * 3 + [False] * 4 + [True] * 2)  # [9]


def mixed_prompt_logits(model: DecoderModel, embeds: torch.Tensor) -> torch.Tensor:
    """Logits at every position of the prompt whose middle rows come from `embeds` ([4, hidden])."""
    input_ids = TOKENS_A + [0] * len(EMBEDDED) + TOKENS_B  # 0 at embedding positions, as the runner sends
    inputs_embeds = torch.zeros(len(PROMPT), model.config.hidden_size, dtype=embeds.dtype)
    inputs_embeds[~IS_TOKEN_IDS] = embeds
    return PagedRun(model).step([("s", input_ids)], True, inputs_embeds, IS_TOKEN_IDS)


def token_logits(model: DecoderModel) -> torch.Tensor:
    return PagedRun(model).step([("s", PROMPT)], all_logits=True)


def test_embedding_rows_equal_to_the_token_embeddings_give_the_token_logits(qwen3_fp32: DecoderModel) -> None:
    embeds = qwen3_fp32.embed_tokens(torch.tensor(EMBEDDED))
    assert torch.equal(mixed_prompt_logits(qwen3_fp32, embeds), token_logits(qwen3_fp32))


def test_different_embeddings_change_the_logits_from_their_position_on(qwen3_fp32: DecoderModel) -> None:
    embeds = qwen3_fp32.embed_tokens(torch.tensor(EMBEDDED)) + 0.5
    mixed, tokens = mixed_prompt_logits(qwen3_fp32, embeds), token_logits(qwen3_fp32)
    assert torch.equal(mixed[:3], tokens[:3])  # causal: positions before the embeddings are untouched
    assert (mixed[3:] - tokens[3:]).abs().amax(-1).gt(1e-3).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dummy_inputs_give_exactly_the_token_path(checkpoints: dict[str, Checkpoint], dtype: str) -> None:
    model = load_model(checkpoints["qwen3"].path, dtype=dtype).model
    run_dummy, run_plain = PagedRun(model), PagedRun(model)
    zeros = torch.zeros(len(PROMPT), model.config.hidden_size, dtype=model.config.dtype)
    all_true = torch.ones(len(PROMPT), dtype=torch.bool)
    dummy = run_dummy.step([("s", PROMPT)], True, zeros, all_true)
    plain = run_plain.step([("s", PROMPT)], all_logits=True)
    assert torch.equal(dummy, plain)
    # Decode steps too, and the KV caches they leave behind.
    assert torch.equal(
        run_dummy.step([("s", [7])], False, zeros[:1], all_true[:1]), run_plain.step([("s", [7])])
    )
    assert all(torch.equal(a, b) for a, b in zip(run_dummy.kv_caches, run_plain.kv_caches, strict=True))


def test_an_embedding_only_prompt_runs(qwen3_fp32: DecoderModel) -> None:
    embeds = torch.randn(5, qwen3_fp32.config.hidden_size)
    logits = PagedRun(qwen3_fp32).step([("s", [0] * 5)], False, embeds, torch.zeros(5, dtype=torch.bool))
    assert logits.shape == (1, qwen3_fp32.config.vocab_size) and logits.isfinite().all()
