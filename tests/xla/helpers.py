"""Engines on XLA's CPU device and their CPU twins, and the prompts every Neuron test feeds both."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tandem.common.torch_part.prompt_parts import EmbeddingPrompt, PromptPart
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.models.loader import load_model

# The static-shape bucket sizes: an XLA engine's compiles, nothing to an eager one.
BUCKET_KEYS = ("seq_buckets", "token_buckets", "block_table_buckets")


def settings(model_dir: Path, **overrides: object) -> dict[str, object]:
    """A small engine: few buckets (each is a compile), float32 unless told otherwise."""
    values: dict[str, object] = dict(
        model_dir=model_dir,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=128,
        num_kv_blocks=96,
        block_size=16,
        seq_buckets=(2, 4),
        token_buckets=(8, 32),
        block_table_buckets=(2, 8),
    )
    values.update(overrides)
    return values


@contextmanager
def engine_on(device: str, **values: object) -> Iterator[Engine]:
    """An engine as `tandem serve decoder --device DEVICE` builds it, started (an XLA one warmed up).

    The same `values` serve both sides of a comparison: the CPU twin runs eager steps, which are not
    padded, so it leaves the bucket sizes out (the config refuses buckets without static shapes)."""
    if device == "neuron":
        values = {**values, "static_shapes": True, "compile": True}
    else:
        values = {k: v for k, v in values.items() if k not in BUCKET_KEYS}
    engine = Engine(EngineConfig(device=device, **values))  # type: ignore[arg-type]
    try:
        engine.start()
        yield engine
    finally:
        engine.shutdown()


def greedy(engine: Engine, prompt: list[PromptPart], num_tokens: int = 32) -> list[int]:
    spec = GenerateSpec(
        prompt, SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=num_tokens, ignore_eos=True)
    )
    return [t for e in engine.generate(spec) if isinstance(e, Delta) for t in e.token_ids]


def table_rows(model_dir: Path, token_ids: list[int], seed: int) -> torch.Tensor:
    """Embedding rows near the checkpoint's own rows for these tokens ([n, hidden] float32): what an
    encoder sends, not bit-equal to the token path."""
    table = load_model(model_dir, dtype="float32").model.embed_tokens.weight
    noise = torch.randn(len(token_ids), table.shape[1], generator=torch.Generator().manual_seed(seed))
    return table[token_ids] + 0.01 * table.std() * noise


def prompts_of_each_kind(
    model_dir: Path, vocab_size: int, count: int = 5
) -> dict[str, list[list[PromptPart]]]:
    """`count` prompts of odd lengths per kind: token IDs, embedding rows only, and the two mixed."""
    kinds: dict[str, list[list[PromptPart]]] = {"tokens": [], "embeddings": [], "mixed": []}
    for i in range(count):
        length = 3 + 4 * i  # 3, 7, 11, ...: odd, and across the prefill buckets
        ids = [(17 * i + 31 * j + 5) % (vocab_size - 2) + 1 for j in range(length)]
        rows = table_rows(model_dir, ids, seed=i)
        kinds["tokens"].append([ids])
        kinds["embeddings"].append([EmbeddingPrompt(rows)])
        half = length // 2
        kinds["mixed"].append([ids[:half], EmbeddingPrompt(rows[half:-1]), ids[-1:]])
    return kinds
