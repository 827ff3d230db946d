"""The weights a Llama, Mistral or Qwen config implies, those it would imply were a flag the other way,
and the one line refusing a weight that disagrees. That they are the weights the decoder's model reads
is services/decoder/tests/models/test_loader.py's and test_checkpoint_shapes.py's."""

from __future__ import annotations

import dataclasses

from tandem.common.weight_shapes import (
    TextModelShape,
    expected_weights,
    flagged_weights,
    mismatch,
    token_table,
)

# SmolLM2-135M's shape: 9 query heads of 64 over 3 KV heads, tied head, no biases.
SMOLLM2 = TextModelShape(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    has_qk_norm=False,
    is_tied=True,
    has_qkv_bias=False,
    has_o_bias=False,
    has_mlp_bias=False,
)


def test_a_llama_layer_has_its_projections_sized_by_heads_and_head_dim() -> None:
    shapes = {name: w.shape for name, w in expected_weights(SMOLLM2).items()}
    layer = {n.removeprefix("model.layers.7."): s for n, s in shapes.items() if ".layers.7." in n}
    assert layer == {
        "input_layernorm.weight": (576,),
        "self_attn.q_proj.weight": (576, 576),
        "self_attn.k_proj.weight": (192, 576),
        "self_attn.v_proj.weight": (192, 576),
        "self_attn.o_proj.weight": (576, 576),
        "post_attention_layernorm.weight": (576,),
        "mlp.gate_proj.weight": (1536, 576),
        "mlp.up_proj.weight": (1536, 576),
        "mlp.down_proj.weight": (576, 1536),
    }
    assert shapes["model.embed_tokens.weight"] == (49152, 576) and shapes["model.norm.weight"] == (576,)
    assert "lm_head.weight" not in shapes  # tied: the head reads the table
    assert len(shapes) == 2 + 30 * 9


def test_qk_norms_biases_and_an_untied_head_are_expected_when_the_config_has_them() -> None:
    shape = dataclasses.replace(
        SMOLLM2,
        num_layers=1,
        has_qk_norm=True,
        is_tied=False,
        has_qkv_bias=True,
        has_o_bias=True,
        has_mlp_bias=True,
    )
    shapes = {name: w.shape for name, w in expected_weights(shape).items()}
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (64,)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (64,)
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == (576,)
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (192,)
    assert shapes["model.layers.0.self_attn.o_proj.bias"] == (576,)
    assert shapes["model.layers.0.mlp.gate_proj.bias"] == (1536,)
    assert shapes["model.layers.0.mlp.down_proj.bias"] == (576,)
    assert shapes["lm_head.weight"] == (49152, 576)


def test_qwen2s_q_k_v_biases_come_without_an_o_proj_bias() -> None:
    """Qwen2 biases q/k/v_proj and not o_proj, where Llama's attention_bias biases all four: the file
    of a Qwen2 has no o_proj.bias, and one expected would refuse every Qwen2 checkpoint."""
    shape = dataclasses.replace(SMOLLM2, num_layers=1, has_qkv_bias=True)
    biases = {n: w.shape for n, w in expected_weights(shape).items() if n.endswith(".bias")}
    assert biases == {
        "model.layers.0.self_attn.q_proj.bias": (576,),
        "model.layers.0.self_attn.k_proj.bias": (192,),
        "model.layers.0.self_attn.v_proj.bias": (192,),
    }


def test_a_disagreeing_weight_is_one_line_naming_both_shapes_and_the_keys_behind_each_dimension() -> None:
    """Five heads where the file holds nine: the query rows say which keys sized them."""
    q_proj = expected_weights(dataclasses.replace(SMOLLM2, num_heads=5))[
        "model.layers.0.self_attn.q_proj.weight"
    ]
    said = mismatch("model.layers.0.self_attn.q_proj.weight", (576, 576), q_proj, "config.json")
    assert said == (
        "weight model.layers.0.self_attn.q_proj.weight has shape [576, 576] in the file, but config.json "
        "implies [320, 576] (num_attention_heads 5 x head_dim 64, hidden_size 576)"
    )
    assert mismatch("model.layers.0.self_attn.q_proj.weight", (320, 576), q_proj, "config.json") is None


def test_the_keys_may_be_another_files_names() -> None:
    keys = {"vocab_size": "llama.vocab_size", "hidden_size": "llama.embedding_length"}
    table = token_table(100, 8, keys)
    assert table.shape == (100, 8) and table.meaning == "llama.vocab_size 100, llama.embedding_length 8"
    assert token_table(49152, 576) == expected_weights(SMOLLM2)["model.embed_tokens.weight"]


def test_the_weights_a_flag_turns_off_are_flagged_with_that_flag() -> None:
    """SmolLM2's config turns every bias, the q/k norms and a separate head off: each of those weights,
    in every layer, is named with the flag that would turn it on, and nothing the model reads is."""
    shape = dataclasses.replace(SMOLLM2, num_layers=2)
    flagged = flagged_weights(shape)
    assert not flagged.keys() & expected_weights(shape).keys()
    layer = {n.removeprefix("model.layers.1."): f for n, f in flagged.items() if ".layers.1." in n}
    assert layer == {
        "self_attn.q_norm.weight": "has_qk_norm",
        "self_attn.k_norm.weight": "has_qk_norm",
        "self_attn.q_proj.bias": "has_qkv_bias",
        "self_attn.k_proj.bias": "has_qkv_bias",
        "self_attn.v_proj.bias": "has_qkv_bias",
        "self_attn.o_proj.bias": "has_o_bias",
        "mlp.gate_proj.bias": "has_mlp_bias",
        "mlp.up_proj.bias": "has_mlp_bias",
        "mlp.down_proj.bias": "has_mlp_bias",
    }
    assert flagged["lm_head.weight"] == "is_tied" and len(flagged) == 1 + 2 * 9


def test_a_shape_with_every_flag_on_but_the_tie_flags_nothing() -> None:
    """A flag that is on adds weights; turned off it only takes them away, so nothing is flagged."""
    shape = dataclasses.replace(
        SMOLLM2, is_tied=False, has_qk_norm=True, has_qkv_bias=True, has_o_bias=True, has_mlp_bias=True
    )
    assert flagged_weights(shape) == {}
