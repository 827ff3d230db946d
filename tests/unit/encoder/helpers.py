"""Test helpers that write adapter directories (PEFT's file layout, random values)."""

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
