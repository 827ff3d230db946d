"""Test helpers that write adapter directories (PEFT's file layout) and projector files, random values."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_prompt_adapter(
    adapter_dir: Path, num_virtual_tokens: int, token_dim: int, peft_type: str = "PROMPT_TUNING"
) -> torch.Tensor:
    """Writes a PEFT prompt-tuning adapter; returns prompt_embeddings [num_virtual_tokens, token_dim]."""
    adapter_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": peft_type,
        "task_type": "CAUSAL_LM",
        "num_virtual_tokens": num_virtual_tokens,
        "token_dim": token_dim,
        "num_transformer_submodules": 1,
        "prompt_tuning_init": "RANDOM",
    }
    (adapter_dir / "adapter_config.json").write_text(json.dumps(config))
    prompt = torch.randn(num_virtual_tokens, token_dim, generator=torch.Generator().manual_seed(1))
    save_file({"prompt_embeddings": prompt}, str(adapter_dir / "adapter_model.safetensors"))
    return prompt


def write_random_projector(
    path: Path, in_features: int, out_features: int, layout: str = "mlp", seed: int = 0, prefix: str = ""
) -> Path:
    """Writes a RANDOMLY INITIALISED projector file (its output is meaningless) in one of the two layouts.

    `layout` is "linear" or "mlp"; `prefix` (e.g. LLAVA_PREFIX) is prepended to every key.
    """
    if layout not in ("linear", "mlp"):
        raise ValueError(f"layout must be linear or mlp, got {layout!r}")
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    if layout == "linear":
        state = {
            "weight": normal(out_features, in_features, std=in_features**-0.5),
            "bias": normal(out_features, std=0.02),
        }
    else:
        state = {
            "0.weight": normal(out_features, in_features, std=in_features**-0.5),
            "0.bias": normal(out_features, std=0.02),
            "2.weight": normal(out_features, out_features, std=out_features**-0.5),
            "2.bias": normal(out_features, std=0.02),
        }
    save_file({prefix + key: value for key, value in state.items()}, str(path), {"format": "pt"})
    return path
