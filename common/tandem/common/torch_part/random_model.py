"""Random-weight Qwen3 (and Llama) checkpoints in Hugging Face format, for fast tests and benchmark shapes.

These are not the default model (that is SmolLM2-135M-Instruct, see
tandem.common.torch_part.model_cache): their output is noise by construction. `make_model` writes a
complete checkpoint directory (config, generation config, safetensors weights, and a byte-level BPE
tokenizer trained on `corpus.txt`) that our loader, transformers' `AutoModelForCausalLM` and
`AutoTokenizer` all load. The output is a function of (shape, seed) alone: two calls write identical
bytes.

Shapes whose vocabulary is larger than the trained tokenizer (bench-small: 32,000 rows against about
1,000 learned tokens) get the rest as reserved tokens `<|reserved_N|>`, as Llama 3 and Qwen reserve
theirs, so every ID the model can sample decodes to visible text instead of nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.common.torch_part.gguf_import import make_world_readable

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
EOS_TOKEN = "<|endoftext|>"
# Appended after the learned vocabulary, as in Qwen's tokenizer, so they take the highest ids.
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 1024  # learned tokens + specials; the corpus supports about 1,400
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Init scales. With std 0.02 everywhere the tied head maps each token's embedding back to itself and
# greedy decoding repeats the prompt's last token forever; projections at 2 / sqrt(fan_in) let the
# layers outweigh the embedding, and greedy output varies (about 25 distinct tokens in 32).
EMBED_STD = 0.02
PROJ_GAIN = 2.0


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int | None  # None: the tokenizer's size rounded up to a multiple of 64
    max_position_embeddings: int
    architecture: str = "Qwen3ForCausalLM"  # or "LlamaForCausalLM" (no q/k norms): the default model's


SHAPES: dict[str, ModelShape] = {
    # Small enough to load and run in tests in milliseconds.
    "tiny-random": ModelShape(
        hidden_size=64,
        intermediate_size=192,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=None,
        max_position_embeddings=4096,
    ),
    # A small model of realistic proportions (Qwen3-like, 41.6M parameters), for benchmarks.
    "bench-small": ModelShape(
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # Qwen3-0.6B's shape with random weights, for device benchmarks (about 1.2 GB in bf16).
    "qwen3-0.6b": ModelShape(
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
    ),
    # The default model's architecture (SmolLM2 is a Llama: tied head, GQA, no q/k norms), as small.
    "tiny-llama": ModelShape(
        hidden_size=64,
        intermediate_size=192,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=None,
        max_position_embeddings=4096,
        architecture="LlamaForCausalLM",
    ),
}


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on corpus.txt; deterministic, and every string round-trips through it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS_PATH.read_text().splitlines(keepends=True), trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def make_model(out_dir: str | Path, shape: str = "tiny-random", seed: int = 0) -> Path:
    """Writes the checkpoint into `out_dir` (created if needed) and returns its path."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is not one of {', '.join(SHAPES)}")
    model_shape = SHAPES[shape]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer()
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab_size = model_shape.vocab_size or -(-num_tokens // 64) * 64
    if vocab_size > num_tokens:
        tokenizer.add_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - num_tokens)])
    eos_token_id = tokenizer.token_to_id(EOS_TOKEN)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    _write_json(out_dir / "config.json", _hf_config(model_shape, vocab_size, eos_token_id))
    _write_json(out_dir / "generation_config.json", {"eos_token_id": eos_token_id, "do_sample": False})
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "bos_token": None,
            "add_bos_token": False,
            "model_max_length": model_shape.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    save_file(_random_weights(model_shape, vocab_size, seed), out_dir / "model.safetensors", {"format": "pt"})
    make_world_readable(out_dir)  # mountable into containers that run as another uid
    return out_dir


def _hf_config(shape: ModelShape, vocab_size: int, eos_token_id: int) -> dict[str, Any]:
    return {
        "architectures": [shape.architecture],
        "model_type": "llama" if shape.architecture == "LlamaForCausalLM" else "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape.num_layers,
        "initializer_range": EMBED_STD,
        "torch_dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "use_cache": True,
    }


def _random_weights(shape: ModelShape, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Tensors under their Hugging Face names, drawn in a fixed order from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    hidden, head_dim = shape.hidden_size, shape.head_dim
    q_size, kv_size = shape.num_heads * head_dim, shape.num_kv_heads * head_dim

    def normal(rows: int, cols: int, std: float | None = None) -> torch.Tensor:
        std = PROJ_GAIN * cols**-0.5 if std is None else std
        return (torch.randn(rows, cols, generator=generator) * std).to(torch.bfloat16)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    weights = {
        "model.embed_tokens.weight": normal(vocab_size, hidden, EMBED_STD),
        "model.norm.weight": ones(hidden),
    }
    for i in range(shape.num_layers):
        prefix = f"model.layers.{i}"
        weights |= {
            f"{prefix}.input_layernorm.weight": ones(hidden),
            f"{prefix}.post_attention_layernorm.weight": ones(hidden),
            f"{prefix}.self_attn.q_proj.weight": normal(q_size, hidden),
            f"{prefix}.self_attn.k_proj.weight": normal(kv_size, hidden),
            f"{prefix}.self_attn.v_proj.weight": normal(kv_size, hidden),
            f"{prefix}.self_attn.o_proj.weight": normal(hidden, q_size),
            f"{prefix}.mlp.gate_proj.weight": normal(shape.intermediate_size, hidden),
            f"{prefix}.mlp.up_proj.weight": normal(shape.intermediate_size, hidden),
            f"{prefix}.mlp.down_proj.weight": normal(hidden, shape.intermediate_size),
        }
        if shape.architecture == "Qwen3ForCausalLM":  # per-head norms on queries and keys
            weights |= {
                f"{prefix}.self_attn.q_norm.weight": ones(head_dim),
                f"{prefix}.self_attn.k_norm.weight": ones(head_dim),
            }
    return weights


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
