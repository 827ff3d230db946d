"""LoRA adapters made by peft on a test checkpoint, and transformers + peft's own greedy tokens: the
reference the decoder's adapters are compared against (peft is a dev dependency only: the decoder
reads the files without it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False


# Different ranks and target modules: a subset of the fused q/k/v, of gate/up, and all seven.
SPECS = {
    "qv4": AdapterSpec(4, 8.0, ("q_proj", "v_proj")),
    "mlp8": AdapterSpec(8, 16.0, ("k_proj", "o_proj", "up_proj", "down_proj"), use_rslora=True),
    "all16": AdapterSpec(
        16, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    ),
}


def make_adapter(model_dir: Path, out_dir: Path, spec: AdapterSpec, seed: int) -> Path:
    """A peft adapter with random non-zero A and B (init_lora_weights=False), saved as safetensors."""
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        init_lora_weights=False,
    )
    peft.get_peft_model(model, config).save_pretrained(out_dir)
    return out_dir


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers + peft's greedy tokens in float32, past EOS (adapter_dir None: the base model's)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # as ignore_eos: past EOS, EOS itself included
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()
