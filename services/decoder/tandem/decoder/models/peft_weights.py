"""adapter_model.safetensors' tensors, checked against one base model and adapter_config.json's settings.

Every tensor is a LoRA weight of the attention or MLP projections (q/k/v/o, gate/up/down) of a layer the
base model has, of the shape the base model's own projection has (so an adapter made for another base
model, whose hidden size or head counts differ, fails naming the first tensor that does not fit), stored
as floating point and finite in float32 and the model's dtype. A tensor peft would not load
(peft_config.py) is refused, as is an update whose gain (scale x |A| x |B|) is past MAX_LORA_GAIN. A
module the config targets but the file holds no tensors for is served unadapted where peft's init leaves
it so (B @ A zero: init_lora_weights true, the default), and refused where peft gives it random weights
of its own (false, null): peft's tokens then differ from any other server's, and from its own at the
next load.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from tandem.decoder.models.adapter_error import AdapterError
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.peft_config import CONFIG_FILE, TARGETS, AdapterSettings, module_key

WEIGHTS_FILE = "adapter_model.safetensors"
# A safetensors header past its 8-byte length: ~130 bytes a tensor, 14 tensors a layer (1 MiB is ~570
# layers), and PEFT's metadata is {"format": "pt"}. What an adapter's file may hold beyond its tensors.
MAX_HEADER_BYTES = 4 << 20
# The widest floating-point dtype safetensors holds (F64): a tensor's most bytes per value.
MAX_ITEM_BYTES = 8


# What a LoRA weight may be stored as: the floating-point dtypes whose values torch checks and casts.
_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The largest gain (scale x |A| x |B|, Frobenius norms: an upper bound of the update's spectral norm) an
# adapter's update may have. Trained ones sit near 1 to 10 (scale 0.5 to 4, |A| ~ sqrt(r / 3) from its
# init, |B| below 1); random ones are larger: ~100 for bench/lora_throughput.py's (std 0.02, r 16, scale 2)
# at Llama-3-8B's 4,096 x 14,336, below 100 for the tests' peft-made ones. At 1e6 an input of unit norm
# leaves the update past float16's range (65,504) 15 times over, a millionfold the base projection's own
# (norm near 1): no fine-tune does that, only overflow, where the output was garbage with no error.
MAX_LORA_GAIN = 1e6


# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT strips the adapter's name): the
# names of modules the base model has, and nothing else, as PEFT loads only those. A layer index with a
# leading zero ("layers.00.") names no module, and read as a number it was layer 0 again, the later of
# the two tensors kept; "self_attn.up_proj" names none either; and 5,000 digits failed int() (INTERNAL).
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(0|[1-9]\d{0,8})\."
    r"(?:self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))\.lora_(A|B)\.weight"
)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target module in the base model's checkpoint."""
    c = config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "q_proj": (q_size, c.hidden_size),
        "k_proj": (kv_size, c.hidden_size),
        "v_proj": (kv_size, c.hidden_size),
        "o_proj": (c.hidden_size, q_size),
        "gate_proj": (c.intermediate_size, c.hidden_size),
        "up_proj": (c.intermediate_size, c.hidden_size),
        "down_proj": (c.hidden_size, c.intermediate_size),
    }


def max_weights_bytes(config: ModelConfig, rank: int) -> int:
    """The largest adapter_model.safetensors an adapter of rank `rank` for this base model can be: every
    target module of every layer, A and B, in float64, and its header."""
    values_per_layer = sum(
        rank * (out_features + in_features) for out_features, in_features in module_shapes(config).values()
    )
    return 8 + MAX_HEADER_BYTES + MAX_ITEM_BYTES * config.num_layers * values_per_layer


def read_weights(
    data: bytes, config: ModelConfig, settings: AdapterSettings
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes, rank = module_shapes(config), settings.rank
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}  # (layer, module) -> its lora_B tensor's name
    try:  # safetensors checks the header (its length, offsets, dtypes) against the bytes read
        tensors = load_safetensors(data)
    except SafetensorError as error:  # parsed from memory: its message names no path
        raise AdapterError(WEIGHTS_FILE, f"is not a safetensors file: {error}") from None
    for name in sorted(tensors):
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise AdapterError(
                f"{WEIGHTS_FILE}:{name}",
                "is not a LoRA weight of a decoder layer's self_attn.q_proj, k_proj, v_proj, o_proj or "
                "mlp.gate_proj, up_proj, down_proj",
            )
        layer, module, half = int(match.group(1)), match.group(2) or match.group(3), match.group(4)
        if layer >= config.num_layers:
            raise AdapterError(
                f"{WEIGHTS_FILE}:{name}", f"names layer {layer}; the base model has {config.num_layers}"
            )
        # Refused, not dropped: a tensor peft would not load says the file and its config disagree.
        if (why := settings.why_not_adapted(layer, module)) is not None:
            raise AdapterError(f"{WEIGHTS_FILE}:{name}", why)
        out_features, in_features = shapes[module]
        want = (rank, in_features) if half == "A" else (out_features, rank)
        tensor = tensors[name]
        shape = tuple(tensor.shape)
        if shape != want:
            raise AdapterError(
                f"{WEIGHTS_FILE}:{name}",
                f"has shape {list(shape)}, expected {list(want)} (r {rank} and the base model's "
                f"{module}: in {in_features}, out {out_features})",
            )
        # Before any arithmetic on it: float8 has no isfinite (INTERNAL), an integer no NaN to find.
        if tensor.dtype not in _WEIGHT_DTYPES:
            stored = str(tensor.dtype).removeprefix("torch.")
            raise AdapterError(
                f"{WEIGHTS_FILE}:{name}",
                f"is stored as {stored}: must be F16, BF16, F32 or F64 (floating point)",
            )
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{WEIGHTS_FILE}:{name}", "must hold finite floating-point values")
        # Finite in the file's float64 may be Inf once in float32, or in the slots' dtype
        # (float16 ends at 65504): every request on the adapter would then sample from NaN.
        if not (torch.isfinite(tensor.float()).all() and torch.isfinite(tensor.to(config.dtype)).all()):
            dtype = str(config.dtype).removeprefix("torch.")
            raise AdapterError(
                f"{WEIGHTS_FILE}:{name}", f"holds values beyond float32's or the model's {dtype} range"
            )
        halves.setdefault((layer, module), {})[half] = tensor.float()
        names[(layer, module)] = name.replace(".lora_A.", ".lora_B.")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(WEIGHTS_FILE, f"layer {layer} {module} has no {missing} weight")
        # scale * |A| * |B| (Frobenius norms, in float64) bounds the update's gain, |scale * B @ A| for
        # any input. Past MAX_LORA_GAIN every request on the adapter emits garbage with no error: with
        # lora_alpha 1e30 the hidden states overflow, and the logits came out finite but flat (token 0,
        # logprob -ln(vocab) for ever), so the sampler's non-finite check never saw them.
        gain = settings.scale * pair["A"].double().norm().item() * pair["B"].double().norm().item()
        if not abs(gain) <= MAX_LORA_GAIN:
            raise AdapterError(
                f"{WEIGHTS_FILE}:{names[(layer, module)]}",
                f"with lora_alpha / r = {settings.scale:.3g} this update can multiply an input by "
                f"{abs(gain):.3g} (scale x |A| x |B|), over the {MAX_LORA_GAIN:.0e} past which no model's "
                f"activations stay meaningful (from {CONFIG_FILE}:lora_alpha or the weights)",
            )
        weights[(layer, module)] = (pair["A"], pair["B"])
    if not weights:
        raise AdapterError(WEIGHTS_FILE, "holds no LoRA weights")
    return weights


def check_absent(
    weights: Mapping[tuple[int, str], object], config: ModelConfig, settings: AdapterSettings, shown: str
) -> None:
    """Refuses an adapter whose config targets modules its file holds no tensors for, unless peft's init
    leaves such a module as the base model has it (peft_config.py's NOTE): peft adapts every module the
    config targets, a missing one with its init's A and B and only a warning, and vLLM leaves it
    unadapted whatever the init; serving the file alone then gives other tokens than peft with no error."""
    if settings.absent_is_base:
        return
    absent = [
        (layer, module)
        for layer in range(config.num_layers)
        for module in TARGETS
        if (layer, module) not in weights and settings.why_not_adapted(layer, module) is None
    ]
    if absent:
        more = f" and {len(absent) - 1} more module(s)" if len(absent) > 1 else ""
        raise AdapterError(
            WEIGHTS_FILE,
            f"in {shown} holds no lora_A/lora_B for {module_key(*absent[0])}{more}, which "
            f"{CONFIG_FILE}:target_modules targets; with init_lora_weights "
            f"{json.dumps(settings.init_lora_weights)} peft gives such a module random weights of its "
            "own (other tokens, only a warning): save every targeted module's weights, narrow "
            "target_modules to those saved, or set init_lora_weights true where the absent ones were left "
            "untrained (peft then leaves them as the base model has them)",
        )
