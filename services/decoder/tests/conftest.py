"""Tiny random checkpoints that transformers itself built and saved, one per model family variant.

Each is saved once per session and loaded by our loader in float32; tests compare against the
transformers model that wrote it. The shared ones (the tiny random model, the default model) come from
common/tests/fixtures.py; tiny_fp32, the tiny model loaded by the decoder, from fixtures.py here,
which the cross-service tests import too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from common.tests.fixtures import environ, smollm2_dir, tiny_model_dir  # noqa: F401  (fixtures, by name)
from services.decoder.tests.fixtures import tiny_fp32  # noqa: F401
from tandem.common.torch_part.random_model import train_tokenizer
from tandem.decoder.models.loader import load_model

from .models.helpers import save_hf_checkpoint

VOCAB_SIZE = 1024  # the trained test tokenizer's size
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "max_position_embeddings": 512,
    # Wider than the default 0.02 so logits of random weights are far apart and greedy has no near-ties.
    "initializer_range": 0.1,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

# name -> (transformers class, config, config.json keys to remove after saving)
VARIANTS: dict[str, tuple[type, Any, tuple[str, ...]]] = {
    # GQA, tied head, head_dim (32) unrelated to hidden_size / num_heads (16).
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(
            **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True
        ),
        (),
    ),
    # Llama 3.x: GQA, untied head, llama3 RoPE scaling that bites within a short prompt.
    "llama3": (
        LlamaForCausalLM,
        LlamaConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        (),
    ),
    # Llama 2 style: multi-head, biases on, no head_dim in config.json.
    "llama2-bias": (
        LlamaForCausalLM,
        LlamaConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
        ),
        ("head_dim",),
    ),
    # Qwen2 / Qwen2.5 (0.5B, 1.5B): GQA, tied head, biases on q/k/v_proj but none on o_proj.
    "qwen2": (
        Qwen2ForCausalLM,
        Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        (),
    ),
    # Mistral v0.3: GQA, untied head, no biases, sliding_window null (the whole context).
    "mistral": (
        MistralForCausalLM,
        MistralConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            sliding_window=None,
        ),
        (),
    ),
}


@dataclass
class Checkpoint:
    path: Path
    hf_model: Any  # the transformers model that saved it, float32, eval mode


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer = train_tokenizer()
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    tokenizer.save(str(path))
    return path


def _build_checkpoint(name: str, out_dir: Path, tokenizer_file: Path, **save_kwargs: Any) -> Checkpoint:
    hf_class, config, drop_keys = VARIANTS[name]
    torch.manual_seed(0)
    hf_model = hf_class(config).train(False)
    with torch.no_grad():
        for n, p in hf_model.named_parameters():
            # transformers starts biases at 0 and norm weights at 1; random values show ours are used.
            if n.endswith(".bias"):
                p.normal_(std=0.1)
            elif "norm" in n:
                p.normal_(mean=1.0, std=0.1)
    save_hf_checkpoint(hf_model, out_dir, tokenizer_file, drop_keys, **save_kwargs)
    return Checkpoint(out_dir, hf_model)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer_file: Path) -> dict[str, Checkpoint]:
    return {name: _build_checkpoint(name, tmp_path_factory.mktemp(name), tokenizer_file) for name in VARIANTS}


@pytest.fixture(params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, checkpoints: dict[str, Checkpoint]) -> Checkpoint:
    return checkpoints[request.param]


@pytest.fixture(scope="session")
def qwen3_fp32(checkpoints: dict[str, Checkpoint]) -> Any:
    """Our Qwen3 variant in float32: the model most behaviour tests run on."""
    return load_model(checkpoints["qwen3"].path, dtype="float32").model


@pytest.fixture
def hf_checkpoint_factory(tmp_path: Path, tokenizer_file: Path) -> Any:
    """Saves a fresh copy of a variant (for tests that edit or reshard the files)."""

    def build(name: str, **save_kwargs: Any) -> Checkpoint:
        return _build_checkpoint(name, tmp_path / name, tokenizer_file, **save_kwargs)

    return build
