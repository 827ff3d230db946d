"""What an adapter's `adapter_config.json` may say, and which modules it then has peft adapt.

NOTE: every setting of peft's LoraConfig that changes what peft computes is either honoured exactly or
refused, never ignored: an ignored one served other tokens than peft with no error. Honoured: r,
lora_alpha, use_rslora, and which modules peft adapts (target_modules as a list, "all-linear" or a
regular expression, exclude_modules as a list or a regular expression, layers_to_transform with the
default or a plain layers_pattern, neither beside a string target_modules, as in peft), matched as
peft's check_target_module_exists matches them; a tensor of a module peft would not adapt is refused
naming it and the setting. A name in a list that is no module of the base model matches nothing, as in
peft and vLLM (lists written for several model types name W_pack, query_key_value...); one that names a
module this server does not adapt (lm_head, embed_tokens, a norm, rotary_emb, act_fn, a whole layer) is
refused, as is a list or pattern that names none it does: peft would adapt or fail on the one, and find
nothing to adapt in the other. A pattern is matched by module_pattern.py, in a worker with a CPU time
limit. Accepted whatever their value: the few in _IGNORED, which change nothing at inference. Any other
key (one peft added since, too) must be unset (null, false, {} or []); null is the default for
use_rslora, as peft reads it. Refused as this server cannot match peft surely, or at all: null
target_modules (peft picks its own per model type), and initialisations that change the base model's
weights.

NOTE: init_lora_weights matters at inference only for a module the config targets but the weights file
holds no tensors for: peft adapts it all the same, with its init's A and B, and only warns of the missing
keys. Its init leaves such a module as the base model has it where B @ A is zero (`absent_is_base`):
true, "gaussian" and "eva" zero B; "orthogonal" draws A and B from disjoint rows of one orthogonal matrix,
so B @ A is zero but for rounding, drawn afresh at each load (tiny Qwen3 in float32: logits 2.6e-7 from
the base's; its update in bfloat16 at 4096 x 4096, r 16: 5e-3 of the projection's output, 3 times the
rounding of that output itself). false and null keep nn.Linear's own random init for both (peft's
`elif init_lora_weights:` skips null too): the same tiny model's logits moved 0.16, the whole adapter's
effect being 0.29.
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass
from typing import Any

import torch

from tandem.decoder.models.adapter_error import AdapterError
from tandem.decoder.models.module_pattern import PatternError, fullmatches

CONFIG_FILE = "adapter_config.json"

# The checkpoint modules an adapter may target (models/lora.py: the fused projection each is part of).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = frozenset(("q_proj", "k_proj", "v_proj", "o_proj"))
# peft's shorthand (case-insensitive) for every linear layer but the output one: for these models, TARGETS.
_ALL_LINEAR = "all-linear"
# peft's LoraConfig default where adapter_config.json has no lora_alpha (not r: alpha 8 over r 16 is 0.5).
_DEFAULT_ALPHA = 8

# Settings read here, each below.
_HANDLED = frozenset(
    (
        "peft_type",
        "r",
        "lora_alpha",
        "use_rslora",
        "bias",
        "init_lora_weights",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
    )
)
# Settings that change nothing peft computes from saved weights at inference: metadata, training-only
# knobs (dropout is off at inference), and knobs read only with a setting refused here unless unset
# (megatron_core with megatron_config, qalora_group_size with use_qalora, loftq_config with
# init_lora_weights "loftq"; ensure_weight_tying ties embeddings and lm_head, never adapted here;
# runtime_config's ephemeral_gpu_offload only moves DoRA's set-up).
_IGNORED = frozenset(
    (
        "task_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "lora_dropout",
        "runtime_config",
        "megatron_core",
        "qalora_group_size",
        "loftq_config",
        "ensure_weight_tying",
        "eva_config",  # read only while training, to find EVA's initial A
    )
)
# Why each known setting that changes the computation cannot be served; any other key set says so too.
_UNSUPPORTED = {
    "use_dora": "DoRA is not supported",
    "fan_in_fan_out": "fan_in_fan_out weights (Conv1D models) are not supported",
    "lora_bias": "LoRA bias terms are not supported",
    "modules_to_save": "fully trained modules (modules_to_save) are not supported",
    "rank_pattern": "per-module ranks are not supported",
    "alpha_pattern": "per-module alphas are not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA: the adapter acts only after its invocation tokens) "
    "is not supported",
    "layer_replication": "layer_replication (base layers stacked again) is not supported",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices) are not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "use_qalora": "QA-LoRA (pooled inputs) is not supported",
    "megatron_config": "Megatron parallel LoRA layers are not supported",
}
# init_lora_weights known to leave the base model's weights as they are (PiSSA, OLoRA, LoftQ, CorDA...
# replace them with a residual the adapter was trained against): "eva" only zeroes B, "orthogonal" sets A
# and B (peft's lora/layer.py update_layer); the saved A and B replace them all. None: peft initialises
# nothing.
_PLAIN_INITS = (True, False, None, "gaussian", "eva", "orthogonal")
# Those whose B @ A is zero, so a targeted module the file lacks is the base model's in peft too.
_BASE_PRESERVING_INITS = (True, "gaussian", "eva", "orthogonal")
# A layers_pattern peft's regex reads as the literal name it is.
_PLAIN_NAME = re.compile(r"[A-Za-z_]\w*")

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60
_short.maxlong = 40


@dataclass(frozen=True)
class AdapterSettings:
    """adapter_config.json once checked: the scale and which modules peft adapts."""

    rank: int  # r
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r)), finite in float32
    # A module's name or one of its dotted suffixes ("all-linear": TARGETS; a regular expression: the full
    # names it fullmatches, which peft adapts whatever layers_to_transform says, as a name given whole).
    target_modules: frozenset[str]
    exclude_modules: frozenset[str]  # as target_modules; wins over it
    # layers_to_transform: the layers a suffix in target_modules adapts; None: every layer. Empty where
    # layers_pattern finds no layer index in these models' names (peft then adapts no such module).
    layers: frozenset[int] | None
    init_lora_weights: bool | str | None  # as adapter_config.json says it (true where unset)

    @property
    def absent_is_base(self) -> bool:
        """Whether peft's init leaves a targeted module the weights file lacks as the base model has it
        (the module NOTE): only then may the server leave it unadapted and still match peft."""
        return _is_one_of(self.init_lora_weights, _BASE_PRESERVING_INITS)

    def why_not_adapted(self, layer: int, module: str) -> str | None:
        """None where peft adapts `module` of `layer`; else why not, naming the setting."""
        key = module_key(layer, module)
        suffixes = _dotted_suffixes(key)
        if key in self.exclude_modules or suffixes & self.exclude_modules:
            return f"{CONFIG_FILE}:exclude_modules excludes {key}: peft would not load it"
        if key in self.target_modules:  # named whole, peft skips the layer check
            return None
        if not suffixes & self.target_modules:
            return f"{CONFIG_FILE}:target_modules does not name {key}: peft would not load it"
        if self.layers is not None and layer not in self.layers:
            return f"{CONFIG_FILE}:layers_to_transform leaves out layer {layer}: peft would not load it"
        return None


def module_key(layer: int, module: str) -> str:
    """The module's name in the base model, as peft matches target_modules against it."""
    return f"model.layers.{layer}.{'self_attn' if module in _ATTENTION else 'mlp'}.{module}"


def _dotted_suffixes(key: str) -> frozenset[str]:
    """The entries `key.endswith("." + entry)` holds for: "q_proj", "self_attn.q_proj", ... up to
    "layers.0.self_attn.q_proj"."""
    parts = key.split(".")
    return frozenset(".".join(parts[i:]) for i in range(1, len(parts)))


def check_config(
    settings: dict[str, Any], max_rank: int, num_layers: int, *, has_qk_norm: bool
) -> AdapterSettings:
    """The settings, once every one the serving side cannot honour is ruled out. Raises AdapterError.
    has_qk_norm: the base model's attention has q_norm and k_norm (Qwen3's); a name or pattern reaching
    them is refused only where they exist, as peft finds only the modules the model has."""

    def refuse(key: str, why: str) -> AdapterError:
        return AdapterError(f"{CONFIG_FILE}:{key}", why)

    if settings.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"must be LORA, got {_short.repr(settings['peft_type'])}")
    rank = settings.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse("r", f"must be a positive integer, got {_short.repr(rank)}")
    if rank > max_rank:
        raise refuse("r", f"{_short.repr(rank)} is more than the server's --max-lora-rank {max_rank}")
    alpha = settings.get("lora_alpha", _DEFAULT_ALPHA)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise refuse("lora_alpha", f"must be a finite number, got {_short.repr(alpha)}")
    try:  # an integer of 400 digits is past any float (OverflowError)
        alpha_value = float(alpha)
    except OverflowError:
        alpha_value = math.inf
    if math.isnan(alpha_value):
        raise refuse("lora_alpha", f"must be a finite number, got {_short.repr(alpha)}")
    use_rslora = settings.get("use_rslora") or False  # peft: `if use_rslora`, so null is false
    if not isinstance(use_rslora, bool):  # peft reads "false" as true
        raise refuse("use_rslora", f"must be true or false, got {_short.repr(use_rslora)}")
    scale = alpha_value / (math.sqrt(rank) if use_rslora else rank)
    if not abs(scale) <= torch.finfo(torch.float32).max:  # the slots keep scales in float32
        raise refuse(
            "lora_alpha", f"{_short.repr(alpha)} gives a scale (lora_alpha / r) over float32's range"
        )
    for key, value in settings.items():
        if key in _HANDLED or key in _IGNORED or _is_unset(value):
            continue
        if key in _UNSUPPORTED:
            raise refuse(key, f"{_UNSUPPORTED[key]}, got {_short.repr(value)}")
        # A key no peft version writes is the file's own text: quoted, cut short and escaped like a value
        # (a lone surrogate such as JSON's "\udcff" cannot be sent in a status as it is).
        why = "is not a setting this server knows to leave peft's computation as it is"
        raise refuse(_short.repr(key), f"{why}, got {_short.repr(value)}")
    if settings.get("bias", "none") != "none":
        raise refuse(
            "bias", f"must be 'none' (bias terms are not supported), got {_short.repr(settings['bias'])}"
        )
    init = settings.get("init_lora_weights", True)
    if not _is_one_of(init, _PLAIN_INITS):
        raise refuse(
            "init_lora_weights",
            "must be true, false, 'gaussian', 'eva' or 'orthogonal' (others change the base model's "
            f"weights), got {_short.repr(init)}",
        )
    if init == "orthogonal" and rank % 2:
        raise refuse("init_lora_weights", f"'orthogonal' needs an even r (peft's own check), got r {rank}")
    for key in ("layers_to_transform", "layers_pattern"):  # peft's LoraConfig refuses these (even [])
        if isinstance(settings.get("target_modules"), str) and settings.get(key) is not None:
            raise refuse(
                key,
                "cannot be used when target_modules is a string (a regular expression or 'all-linear'), "
                f"as in peft, got {_short.repr(settings[key])}",
            )
    model = _ModelNames(num_layers, has_qk_norm)
    exclude_modules = _module_names(settings.get("exclude_modules"), "exclude_modules", model, refuse)
    return AdapterSettings(
        rank=rank,
        scale=scale,
        target_modules=_target_modules(settings.get("target_modules"), exclude_modules, model, refuse),
        exclude_modules=exclude_modules,
        layers=_layers(settings.get("layers_to_transform"), settings.get("layers_pattern"), refuse),
        init_lora_weights=init,
    )


def _is_one_of(init: object, inits: tuple[bool | str | None, ...]) -> bool:
    """By identity for true, false and null (1 == True, 0 == False), by value for a string."""
    return any(init is plain or (isinstance(plain, str) and init == plain) for plain in inits)


def _is_unset(value: object) -> bool:
    """peft's defaults for settings that add something: null, false, {} or [] (not 0: a number is set)."""
    return value is None or value is False or (isinstance(value, dict | list) and not value)


def _module_names(value: object, key: str, model: _ModelNames, refuse: Any) -> frozenset[str]:
    """A list of module names (empty where unset); a string is peft's regular expression, read as the
    full names of the modules it fullmatches, served or not (which peft treats as a name given whole)."""
    if value is None or value == "" or value == []:
        return frozenset()
    if isinstance(value, str):
        try:
            return fullmatches(value, _served_keys(model.num_layers) + _unserved_keys(model))
        except PatternError as error:
            raise refuse(key, f"{error}, got {_short.repr(value)}") from None
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise refuse(key, f"must be a list of module names, got {_short.repr(value)}")
    return frozenset(value)


def _target_modules(
    value: object, exclude_modules: frozenset[str], model: _ModelNames, refuse: Any
) -> frozenset[str]:
    if value is None:
        raise refuse(
            "target_modules", "must list the modules adapted (null: peft picks its own per model type)"
        )
    if isinstance(value, str) and value.lower() == _ALL_LINEAR:
        return frozenset(TARGETS)
    names = _module_names(value, "target_modules", model, refuse)
    if value == "" or value == []:
        raise refuse("target_modules", f"must list the modules adapted, got {_short.repr(value)}")
    for key in _unserved_keys(model):
        suffixes = _dotted_suffixes(key)
        if key in exclude_modules or suffixes & exclude_modules:  # excluded wins: peft leaves it be
            continue
        if key in names or suffixes & names:
            name = key if key in names else min(suffixes & names, key=len)
            raise refuse(
                "target_modules",
                f"{_short.repr(name)} names {key}, which this server does not adapt (only "
                f"{', '.join(TARGETS)}): peft would adapt it or fail, got {_short.repr(value)}",
            )
    if not any(_names_a_module(name, model.num_layers) for name in names):
        raise refuse(
            "target_modules",
            f"names none of the base model's {', '.join(TARGETS)} (peft would find no module to adapt), "
            f"got {_short.repr(value)}",
        )
    return names


def _served_keys(num_layers: int) -> list[str]:
    return [module_key(layer, module) for layer in range(num_layers) for module in TARGETS]


@dataclass(frozen=True)
class _ModelNames:
    """What decides the base model's module names beside TARGETS."""

    num_layers: int
    has_qk_norm: bool


def _unserved_keys(model: _ModelNames) -> list[str]:
    """The modules the base model has beside TARGETS, as transformers names them (Llama, Mistral, Qwen2 and
    Qwen3 alike, but q_norm and k_norm Qwen3's only, and rotary_emb the model's, not each layer's, in all
    four): peft would adapt lm_head or embed_tokens, and refuse a norm, a rotary embedding, an activation
    or a container. Only names the model has: a pattern peft loads on Llama (`.*\\.self_attn\\..*`) must
    not be refused for a Qwen3 q_norm that Llama lacks."""
    qk_norm = (".self_attn.q_norm", ".self_attn.k_norm") if model.has_qk_norm else ()
    per_layer = (
        "",
        ".self_attn",
        *qk_norm,
        ".mlp",
        ".mlp.act_fn",
        ".input_layernorm",
        ".post_attention_layernorm",
    )
    layers = [f"model.layers.{layer}{part}" for layer in range(model.num_layers) for part in per_layer]
    return [
        "model",
        "model.embed_tokens",
        "model.rotary_emb",
        "model.layers",
        *layers,
        "model.norm",
        "lm_head",
    ]


def _names_a_module(name: str, num_layers: int) -> bool:
    """Whether `name` is module_key(layer, module) of some layer and target module, or a dotted suffix."""
    *path, module = name.split(".")
    if module not in TARGETS:
        return False
    expected = ["model", "layers", None, "self_attn" if module in _ATTENTION else "mlp"]
    if len(path) > len(expected):
        return False
    for part, want in zip(path, expected[len(expected) - len(path) :], strict=True):
        if want is None:
            if not re.fullmatch(r"0|[1-9]\d{0,8}", part) or int(part) >= num_layers:
                return False
        elif part != want:
            return False
    return True


def _layers(value: object, pattern: object, refuse: Any) -> frozenset[int] | None:
    """layers_to_transform as peft reads it for these models' module names, layers_pattern with it."""
    if value is None or value == []:  # peft: every layer
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        layers = frozenset((value,))
    elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        layers = frozenset(value)
    else:
        raise refuse(
            "layers_to_transform", f"must be a layer index or a list of them, got {_short.repr(value)}"
        )
    if pattern is None or pattern == "" or pattern == []:  # peft's default finds model.layers.<i>.
        return layers
    patterns = [pattern] if isinstance(pattern, str) else pattern
    if not isinstance(patterns, list) or not all(
        isinstance(p, str) and _PLAIN_NAME.fullmatch(p) for p in patterns
    ):
        raise refuse("layers_pattern", f"must be a name or a list of names, got {_short.repr(pattern)}")
    # peft's (?:^|.*?\.)<name>\.(\d+)\. finds an index in model.layers.<i>.… only for the name "layers".
    return layers if "layers" in patterns else frozenset()
