"""Two gloo ranks against one: the same logits (1e-5 relative) and greedy tokens, step for step,
and the same prompt logprobs (their rows are sequence-parallel like every prefill row).

The script covers token, embedding-only and mixed prompts packed in one prefill of an odd length,
a chunked prefill sharing steps with decodes, and decode-only steps (see scenarios.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.models.loader import load_model

from . import scenarios
from .harness import run_ranks


def _assert_same_logits(tp_logits: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    assert len(tp_logits) == len(reference)
    for step, (got, want) in enumerate(zip(tp_logits, reference, strict=True)):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=f"step {step}")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"greedy tokens differ at step {step}"


CHECKPOINTS = ("tiny", "llama2-bias", "qwen2")


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, hf_checkpoint_dirs: dict[str, Path]) -> dict[str, Path]:
    return {name: tiny_model_dir if name == "tiny" else hf_checkpoint_dirs[name] for name in CHECKPOINTS}


@pytest.fixture(scope="module")
def two_rank_logits(model_dirs: dict[str, Path]) -> dict[str, list[list[torch.Tensor]]]:
    """Each checkpoint's script on two ranks, one checkpoint after another in one group: spawning the
    ranks costs more than the script. checkpoint -> each rank's logits."""
    per_rank = run_ranks(scenarios.rank_scripted_logits_each, 2, list(model_dirs.values()))
    return {name: [logits[i] for logits in per_rank] for i, name in enumerate(model_dirs)}


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_two_ranks_match_one_rank_logits_for_every_step(
    checkpoint: str, model_dirs: dict[str, Path], two_rank_logits: dict[str, list[list[torch.Tensor]]]
) -> None:
    model = load_model(model_dirs[checkpoint], dtype="float32").model
    reference = scenarios.scripted_logits(model, world_size=1)
    for logits in two_rank_logits[checkpoint]:  # every rank ends with the full logits
        _assert_same_logits(logits, reference)


def test_each_rank_holds_its_own_slice_of_every_weight_contiguous(tiny_model_dir: Path) -> None:
    """o_proj's and down_proj's slices (cut by input columns) were strided views of the whole tensor:
    each rank held the whole weight, and the C kernel refused them, so those linears ran on F.linear,
    whose sums follow the row count (3 ranks: a decode row beside a prompt chunk got other bits)."""
    # In the file's own dtype: a cast copies, which hid it.
    stored = json.loads((tiny_model_dir / "config.json").read_text()).get("torch_dtype", "float32")
    for held in run_ranks(scenarios.rank_weights_held, 2, tiny_model_dir, stored):
        assert [name for name, contiguous, _, _ in held if not contiguous] == []
        assert [name for name, _, storage, values in held if storage != values] == []


def test_two_rank_engine_generates_what_the_one_rank_engine_does(tiny_model_dir: Path) -> None:
    engine = Engine(scenarios.engine_config(tiny_model_dir)).start()
    try:
        reference = scenarios.engine_outputs(engine)
    finally:
        engine.shutdown()
    rank0, rank1 = run_ranks(scenarios.rank_engine_outputs, 2, tiny_model_dir)
    assert rank1 is None  # the worker ran until rank 0's STOP
    for (tokens, logprobs, top, prompt), (ref_tokens, ref_logprobs, ref_top, ref_prompt) in zip(
        rank0, reference, strict=True
    ):
        assert tokens == ref_tokens
        assert len(prompt) == len(ref_prompt) > 0
        torch.testing.assert_close(torch.tensor(prompt), torch.tensor(ref_prompt), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(top), torch.tensor(ref_top), rtol=1e-5, atol=1e-5)
