"""An adapter's tensors checked against the base model and adapter_config.json: each refusal names the
tensor, and a module the file lacks is served as peft serves it or refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.decoder.models.loader import LoadedModel
from tandem.decoder.models.peft_adapter import AdapterError, read_adapter
from tandem.decoder.models.peft_weights import WEIGHTS_FILE

from .peft_copies import copy_with


def test_a_tensor_for_another_base_model_is_refused_naming_it(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    out = copy_with(adapter_dir, tmp_path / "a", r=4, target_modules=["q_proj"])
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file(
        {name.format("A"): torch.ones(4, 32), name.format("B"): torch.ones(64, 4)},
        out / "adapter_model.safetensors",
    )
    with pytest.raises(AdapterError, match=r"has shape \[4, 32\], expected \[4, 64\]") as raised:
        read_adapter(out, tiny_fp32.config, max_rank=16)
    assert raised.value.field == f"adapter_model.safetensors:{name.format('A')}"


@pytest.mark.parametrize(
    ("tensors", "says"),
    [
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 64)}, "no lora_B"),
        ({"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.ones(4, 64)}, "layer 9"),
        ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 64)}, "is not a LoRA weight"),
        # Names no module of the base model has, which PEFT would not load: "layers.00." was read as
        # layer 0 (the later of the two tensors served), "self_attn.up_proj" as mlp.up_proj, and a
        # layer of 5,000 digits failed int() (INTERNAL).
        (
            {
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 64),
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(64, 4),
                "base_model.model.model.layers.00.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
                "base_model.model.model.layers.00.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
            },
            "layers.00.self_attn.q_proj.lora_A.weight: is not a LoRA weight",
        ),
        (
            {
                "base_model.model.model.layers.0.self_attn.up_proj.lora_A.weight": torch.ones(4, 64),
                "base_model.model.model.layers.0.self_attn.up_proj.lora_B.weight": torch.ones(192, 4),
            },
            "self_attn.up_proj.lora_A.weight: is not a LoRA weight",
        ),
        (
            {f"base_model.model.model.layers.{'9' * 5000}.self_attn.q_proj.lora_A.weight": torch.ones(4, 64)},
            "is not a LoRA weight",
        ),
        (
            {
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full(
                    (4, 64), math.nan
                ),
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(64, 4),
            },
            "finite",
        ),
    ],
)
def test_tensors_that_do_not_make_an_adapter_are_refused(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, tensors: dict, says: str
) -> None:
    out = copy_with(adapter_dir, tmp_path / "a", r=4, target_modules="all-linear")
    save_file(tensors, out / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=says):
        read_adapter(out, tiny_fp32.config, max_rank=16)


@pytest.mark.parametrize(
    ("settings", "tensor", "says"),
    [
        # peft builds layers only for the modules these name, and loads no other tensor: the decoder
        # served the file's every tensor, other tokens than peft's with no error.
        ({"target_modules": ["k_proj", "o_proj", "up_proj"]}, "0.mlp.down_proj.lora_A", "target_modules"),
        ({"exclude_modules": ["o_proj"]}, "0.self_attn.o_proj.lora_A", "exclude_modules"),
        ({"layers_to_transform": [1]}, "0.mlp.down_proj.lora_A", "layers_to_transform"),
        ({"target_modules": r".*\.(k_proj|o_proj|up_proj)"}, "0.mlp.down_proj.lora_A", "target_modules"),
        (
            {"exclude_modules": r"model\.layers\.0\.self_attn\..*"},
            "0.self_attn.k_proj.lora_A",
            "exclude_modules",
        ),
    ],
)
def test_a_tensor_peft_would_not_load_is_refused_naming_it_and_the_setting(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, settings: dict, tensor: str, says: str
) -> None:
    with pytest.raises(AdapterError, match=f"adapter_config.json:{says} ") as raised:
        read_adapter(copy_with(adapter_dir, tmp_path / "a", **settings), tiny_fp32.config, max_rank=16)
    assert raised.value.field == f"adapter_model.safetensors:base_model.model.model.layers.{tensor}.weight"


def copy_without(adapter_dir: Path, out: Path, modules: list[str], **settings: object) -> Path:
    """copy_with, its weights file lacking the lora_A and lora_B of `modules` ("1.mlp.up_proj")."""
    copy_with(adapter_dir, out, **settings)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    dropped = {f"base_model.model.model.layers.{m}.lora_{half}.weight" for m in modules for half in "AB"}
    assert dropped <= tensors.keys()
    save_file({k: v for k, v in tensors.items() if k not in dropped}, out / "adapter_model.safetensors")
    return out


# peft 0.21.2 adapts every module adapter_config.json targets, one the file has no tensors for with its
# init's A and B, and only warns of the missing keys. On the tiny model with v_proj of layer 1 left out:
# init_lora_weights false or null (nn.Linear's own random init) moved the logits 0.16 from those of the
# module left unadapted (the whole adapter's effect: 0.29); true, "gaussian" and "eva" (B zero) by 0;
# "orthogonal" (B @ A zero but for rounding, drawn afresh at each load) by 2.6e-7.
@pytest.mark.parametrize("init", [False, None])
def test_a_targeted_module_the_file_lacks_is_refused_where_peft_gives_it_random_weights(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, init: bool | None
) -> None:
    out = copy_without(
        adapter_dir, tmp_path / "a", ["3.mlp.down_proj", "1.mlp.up_proj"], init_lora_weights=init
    )
    with pytest.raises(AdapterError) as raised:
        read_adapter(out, tiny_fp32.config, max_rank=16, shown="team/partial")
    assert raised.value.field == WEIGHTS_FILE
    said = raised.value.description
    assert said.startswith(
        "in team/partial holds no lora_A/lora_B for model.layers.1.mlp.up_proj and 1 more module(s), which "
        f"adapter_config.json:target_modules targets; with init_lora_weights {json.dumps(init)} peft gives "
    )


@pytest.mark.parametrize("init", [True, "gaussian", "eva", "orthogonal", "unset"])
def test_a_targeted_module_the_file_lacks_is_left_as_the_base_model_where_peft_s_init_does_so(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, init: bool | str
) -> None:
    out = copy_without(adapter_dir, tmp_path / "a", ["1.mlp.up_proj"], init_lora_weights=init)
    if init == "unset":  # peft's default: true
        config = json.loads((out / "adapter_config.json").read_text())
        del config["init_lora_weights"]
        (out / "adapter_config.json").write_text(json.dumps(config))
    adapter = read_adapter(out, tiny_fp32.config, max_rank=16)
    assert (1, "up_proj") not in adapter.weights and (2, "up_proj") in adapter.weights
    assert len(adapter.weights) == 4 * tiny_fp32.config.num_layers - 1


def test_an_update_whose_gain_is_past_the_bound_is_refused_naming_its_tensor(
    adapter_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    # lora_alpha 1e30: a finite scale and finite weights, but the hidden states overflowed and every
    # request on the adapter emitted token 0 at logprob -ln(vocab) for ever, with no error.
    loud = copy_with(adapter_dir, tmp_path / "loud", lora_alpha=1e30)
    with pytest.raises(AdapterError, match=r"multiply an input by .* over the 1e\+06") as raised:
        read_adapter(loud, tiny_fp32.config, max_rank=16)
    assert raised.value.field.endswith(".lora_B.weight") and "lora_alpha" in str(raised.value)
    adapter = read_adapter(adapter_dir, tiny_fp32.config, max_rank=16)  # peft's random one: far below
    gain = max(adapter.scale * a.norm() * b.norm() for a, b in adapter.weights.values())
    assert gain < 1e3
