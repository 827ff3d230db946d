"""adapter_config.json's settings: which modules peft adapts by them (peft's own matcher the reference),
which settings are accepted as harmless, and every other one refused naming its field."""

from __future__ import annotations

import pytest

from tandem.decoder.models.adapter_error import AdapterError
from tandem.decoder.models.peft_config import TARGETS, AdapterSettings, check_config, module_key

NUM_LAYERS = 4
BASE = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def settings_of(**changes: object) -> AdapterSettings:
    """Checked for a Qwen3 base model: q_norm and k_norm in every layer's attention."""
    return check_config(BASE | changes, max_rank=16, num_layers=NUM_LAYERS, has_qk_norm=True)


@pytest.mark.parametrize(
    "pattern", [r".*\.self_attn\..*", r".*\.self_attn\.[qk]_.*", r".*\.(q|k)_.*", r".*_(proj|norm)"]
)
def test_a_pattern_reaching_qwen3s_q_norm_is_accepted_for_a_model_without_one(pattern: str) -> None:
    # Llama, Mistral and Qwen2 have no q_norm or k_norm (nor a rotary_emb per layer), so peft 0.21 loads
    # these on Llama, adapting only the projections; refused for Qwen3, whose q_norm peft cannot adapt.
    llama = check_config(
        BASE | {"target_modules": pattern}, max_rank=16, num_layers=NUM_LAYERS, has_qk_norm=False
    )
    assert llama.target_modules and all(name.endswith("_proj") for name in llama.target_modules)
    with pytest.raises(AdapterError, match=r"self_attn\.[qk]_norm, which"):
        settings_of(target_modules=pattern)


@pytest.mark.parametrize(
    "changes",
    [
        {"target_modules": ["q_proj", "down_proj"]},
        {"target_modules": "all-linear"},
        {"target_modules": "ALL-LINEAR"},
        {"target_modules": ["self_attn.q_proj", "layers.1.mlp.up_proj", "model.layers.2.self_attn.o_proj"]},
        {
            "target_modules": ["q_proj", "v_proj", "k_proj"],
            "exclude_modules": ["k_proj", "layers.0.self_attn.q_proj"],
        },
        {"exclude_modules": ["lm_head"]},  # excludes nothing adapted here
        {"layers_to_transform": [0, 2]},
        {"layers_to_transform": 3},
        {"layers_to_transform": [1], "layers_pattern": "layers"},
        {"layers_to_transform": [1], "layers_pattern": ["h", "layers"]},
        {"layers_to_transform": [1], "layers_pattern": "h"},  # finds no index: adapts nothing
        # Named whole, a module is adapted whatever layers_to_transform says (peft skips the check).
        {"target_modules": ["model.layers.3.self_attn.q_proj", "v_proj"], "layers_to_transform": [0]},
        # A string is peft's regular expression, fullmatched against the module's whole name (unsloth and
        # the peft docs write these).
        {"target_modules": r".*\.(q_proj|v_proj|o_proj)$"},
        {"target_modules": r"(?:.*?(?:language|text).*?)?model\.layers\.[0-2]\..*?(?:q_proj|down_proj)"},
        {"target_modules": "all-linear", "exclude_modules": r".*\.layers\.[13]\.mlp\..*"},
        # Names of other model types' modules match nothing here, as in peft.
        {"target_modules": ["q_proj", "v_proj", "W_pack", "query_key_value", "layers.4.self_attn.q_proj"]},
    ],
)
def test_the_modules_adapted_are_those_peft_s_own_matcher_finds(changes: dict) -> None:
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    peft_config = LoraConfig(**{k: v for k, v in (BASE | changes).items() if k != "peft_type"})
    if isinstance(peft_config.target_modules, str) and peft_config.target_modules.lower() == "all-linear":
        peft_config.target_modules = set(TARGETS)  # what peft's inject_adapter makes of it for these models
    settings = settings_of(**changes)
    for layer in range(NUM_LAYERS):
        for module in TARGETS:
            key = module_key(layer, module)
            peft_adapts = bool(check_target_module_exists(peft_config, key))  # an exclusion is falsy
            assert (settings.why_not_adapted(layer, module) is None) == peft_adapts, key


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"exclude_modules": ["v_proj"]}, "exclude_modules", "excludes model.layers.0.self_attn.v_proj"),
        ({"target_modules": ["q_proj"]}, "target_modules", "does not name model.layers.0.self_attn.v_proj"),
        ({"layers_to_transform": [1, 2, 3]}, "layers_to_transform", "leaves out layer 0"),
        ({"layers_to_transform": [0], "layers_pattern": "h"}, "layers_to_transform", "leaves out layer 0"),
    ],
)
def test_why_a_module_is_not_adapted_names_the_setting(changes: dict, field: str, says: str) -> None:
    why = settings_of(**changes).why_not_adapted(0, "v_proj")
    assert why is not None and f"adapter_config.json:{field} " in why and says in why


def test_peft_s_own_saved_settings_and_harmless_ones_are_accepted() -> None:
    from peft import LoraConfig

    saved = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]).to_dict()
    saved = {k: sorted(v) if isinstance(v, set) else v for k, v in saved.items()}
    saved["runtime_config"] = {"ephemeral_gpu_offload": False}
    harmless = {
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M",
        "revision": "main",
        "inference_mode": True,
        "lora_dropout": 0.1,
        "init_lora_weights": "gaussian",
        "peft_version": "0.21.2",
        "auto_mapping": {"base_model_class": "LlamaForCausalLM"},
        "a_setting_peft_adds_later": None,
        "another_one": False,
    }
    for settings in (saved, saved | harmless):
        assert check_config(settings, max_rank=16, num_layers=NUM_LAYERS, has_qk_norm=True).scale == 2.0


@pytest.mark.parametrize(
    "changes",
    [
        # Initialisations that leave the base model's weights as they are: the saved A and B replace them.
        {"init_lora_weights": "orthogonal"},
        {"init_lora_weights": "eva", "eva_config": {"rho": 2.0, "tau": 0.99, "whiten": False}},
        # null is peft's default for these (it reads `if use_rslora`, and initialises nothing for null).
        {"use_rslora": None},
        {"init_lora_weights": None},
    ],
)
def test_settings_that_leave_the_computation_as_peft_s_default_are_accepted(changes: dict) -> None:
    assert settings_of(**changes).scale == 2.0


@pytest.mark.parametrize("init", [True, False, None, "gaussian", "eva", "orthogonal"])
def test_a_module_the_file_lacks_is_the_base_model_s_where_peft_s_own_init_leaves_it_so(
    init: bool | str | None,
) -> None:
    # peft adapts a targeted module the weights file lacks with its init's A and B: B @ A zero (true,
    # "gaussian", "eva"; "orthogonal" to rounding) leaves it as the base model has it, false and null
    # (nn.Linear's random init) do not, so only the former may be served unadapted.
    import warnings

    import peft
    import torch

    class Projection(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(16, 16)

    with warnings.catch_warnings():  # eva without its data: peft warns, and zeroes B all the same
        warnings.simplefilter("ignore")
        made = peft.get_peft_model(
            Projection(), peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=init)
        )
    layer = made.base_model.model.q_proj
    update = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert settings_of(init_lora_weights=init).absent_is_base == (update.abs().max().item() < 1e-6)


def test_without_lora_alpha_the_scale_is_peft_s_default_alpha_over_r() -> None:
    from peft import LoraConfig

    no_alpha = {k: v for k, v in BASE.items() if k != "lora_alpha"} | {"r": 16}
    assert (
        check_config(no_alpha, max_rank=16, num_layers=NUM_LAYERS, has_qk_norm=True).scale
        == LoraConfig().lora_alpha / 16
    )


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"alora_invocation_tokens": [17, 402]}, "alora_invocation_tokens", "aLoRA"),
        ({"layer_replication": [[0, 1], [0, 1]]}, "layer_replication", "not supported"),
        ({"trainable_token_indices": [5]}, "trainable_token_indices", "not supported"),
        ({"target_parameters": ["mlp.experts"]}, "target_parameters", "not supported"),
        ({"use_qalora": True}, "use_qalora", "not supported"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out", "not supported"),
        # A key unknown here is quoted as the file's text: escaped where it cannot be sent as it is.
        ({"a_setting_peft_adds_later": 3}, "'a_setting_peft_adds_later'", "not a setting this server knows"),
        ({"\udcff": 1}, "'\\udcff'", "not a setting this server knows"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights", "change the base model's weights"),
        ({"init_lora_weights": "orthogonal", "r": 3}, "init_lora_weights", "needs an even r"),
        ({"rank_pattern": {"q_proj": 8}, "init_lora_weights": "eva"}, "rank_pattern", "not supported"),
        ({"target_modules": None}, "target_modules", "peft picks its own"),
        ({"target_modules": []}, "target_modules", "must list"),
        ({"target_modules": ""}, "target_modules", "must list"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules", "'lm_head' names lm_head, which"),
        ({"target_modules": ["q_proj", "mlp"]}, "target_modules", "names model.layers.0.mlp, which"),
        ({"target_modules": r".*(proj|head)"}, "target_modules", "'lm_head' names lm_head, which"),
        ({"target_modules": ["layers.4.self_attn.q_proj"]}, "target_modules", "names none of"),
        ({"target_modules": ["mlp.q_proj", "W_pack"]}, "target_modules", "names none of"),
        ({"target_modules": r".*\.c_attn"}, "target_modules", "names none of"),
        ({"target_modules": "q_proj"}, "target_modules", "names none of"),  # fullmatches no whole name
        ({"target_modules": "(q_proj"}, "target_modules", "not a regular expression Python's re compiles"),
        ({"exclude_modules": "[q"}, "exclude_modules", "not a regular expression Python's re compiles"),
        ({"layers_to_transform": "0"}, "layers_to_transform", "a layer index or a list"),
        ({"layers_to_transform": [0], "layers_pattern": "layers|h"}, "layers_pattern", "a name or a list"),
        # Qwen3's norms, rotary embeddings and activations: peft refuses them ("Target module Qwen3RMSNorm ...
        # is not supported"), whether named by a list or a pattern.
        ({"target_modules": ["q_proj", "k_norm"]}, "target_modules", "names model.layers.0.self_attn.k_norm"),
        ({"target_modules": r".*\.(q_proj|q_norm)"}, "target_modules", "self_attn.q_norm, which"),
        ({"target_modules": ["q_proj", "rotary_emb"]}, "target_modules", "names model.rotary_emb, which"),
        ({"target_modules": r".*\.(q_proj|act_fn)"}, "target_modules", "mlp.act_fn, which"),
        # A string target_modules with a layer setting: peft's LoraConfig refuses it, even [].
        ({"target_modules": r".*\.q_proj", "layers_to_transform": [0]}, "layers_to_transform", "is a string"),
        ({"target_modules": r".*\.q_proj", "layers_to_transform": []}, "layers_to_transform", "is a string"),
        ({"target_modules": "all-linear", "layers_to_transform": 1}, "layers_to_transform", "is a string"),
        ({"target_modules": r".*\.q_proj", "layers_pattern": "layers"}, "layers_pattern", "is a string"),
        # Malformed values: each was INTERNAL at LoadAdapter and a traceback at start.
        ({"target_modules": [1, "q_proj"]}, "target_modules", "must be a list of module names"),
        ({"target_modules": [["q_proj"]]}, "target_modules", "must be a list of module names"),
        ({"exclude_modules": [{}]}, "exclude_modules", "must be a list of module names"),
        ({"lora_alpha": 10**400}, "lora_alpha", "over float32's range"),
        ({"use_rslora": "false"}, "use_rslora", "must be true or false"),
    ],
)
def test_settings_the_server_cannot_honour_are_refused_naming_the_field(
    changes: dict, field: str, says: str
) -> None:
    with pytest.raises(AdapterError, match=says) as raised:
        settings_of(**changes)
    assert raised.value.field == f"adapter_config.json:{field}"
    assert len(str(raised.value)) < 400  # a value's repr is cut short: 400 digits are not sent back
