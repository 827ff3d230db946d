"""The kernels a backend binds into the model's one forward (models/kernels.py): each module runs what is
bound for it, in the walk's own order, and what is left unbound runs its torch code."""

from __future__ import annotations

from functools import partial

import torch

from tandem.decoder.models.attention import AttentionMetadata, PagedAttention
from tandem.decoder.models.kernels import LayerKernels, LayerLoop, ModelKernels
from tandem.decoder.models.linear import Projection
from tandem.decoder.models.loader import load_model
from tandem.decoder.models.lora import LoraStep
from tandem.decoder.models.transformer import DecoderLayer, DecoderModel

from ..conftest import Checkpoint
from .helpers import PagedRun

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 1000, 3, 88]
STEPS = [[("a", PROMPT), ("b", PROMPT[:5])], [("a", [7]), ("b", [9])]]  # a prefill step, a decode step
ROWS = [len(PROMPT) + 5, 2]  # each step's rows


class Recording:
    """A projection bound in place of a module: runs that module and records the rows of each call."""

    def __init__(self, module: Projection) -> None:
        self.module = module
        self.bias = module.bias
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.module(x, with_bias)


def recorded(layer: DecoderLayer) -> LayerKernels:
    """Every op of the layer bound to the module it stands for, the projections recorded."""
    a, mlp = layer.self_attn, layer.mlp
    return LayerKernels(
        input_norm=layer.input_layernorm,
        qkv=Recording(a.qkv_proj),
        rope_cache=a.rope_and_cache,
        o=Recording(a.o_proj),
        post_norm=layer.post_attention_layernorm,
        gate_up=Recording(mlp.gate_up_proj),
        down=Recording(mlp.down_proj),
    )


def projections(kernels: LayerKernels) -> list[Recording]:
    bound = [kernels.qkv, kernels.o, kernels.gate_up, kernels.down]
    assert all(isinstance(p, Recording) for p in bound)
    return [p for p in bound if isinstance(p, Recording)]


def logits(model: DecoderModel, kernels: ModelKernels | None) -> list[torch.Tensor]:
    run = PagedRun(model, step=partial(model, kernels=kernels))
    return [run.step(chunks) for chunks in STEPS]


def test_every_op_bound_to_its_own_module_gives_the_plain_forwards_bits_one_call_per_step(
    checkpoint: Checkpoint,
) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    layers = tuple(recorded(layer) for layer in model.layers)
    got = logits(model, ModelKernels(layers))
    assert all(torch.equal(g, w) for g, w in zip(got, logits(model, None), strict=True))
    assert all(p.rows == ROWS for k in layers for p in projections(k))


class Fused:
    """A whole layer bound as one kernel: the layer's own torch code, its calls recorded."""

    def __init__(self, layer: DecoderLayer) -> None:
        self.layer = layer
        self.rows: list[int] = []

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
        attention: PagedAttention,
        scale: float,
        lora_slots: torch.Tensor | None,
    ) -> torch.Tensor:
        assert attention is self.layer.self_attn.attention and scale == self.layer.self_attn.scale
        self.rows.append(h.shape[0])
        return self.layer(h, cos, sin, attn, kv_cache)


def test_a_fused_layer_kernel_runs_in_place_of_every_op_of_its_layer(checkpoint: Checkpoint) -> None:
    model = load_model(checkpoint.path, dtype="bfloat16").model
    fused = Fused(model.layers[0])
    first = recorded(model.layers[0])
    layers = (LayerKernels(qkv=first.qkv, fused=fused), *(recorded(layer) for layer in model.layers[1:]))
    got = logits(model, ModelKernels(layers))
    assert all(torch.equal(g, w) for g, w in zip(got, logits(model, None), strict=True))
    assert fused.rows == ROWS and projections(first)[0].rows == []  # the layer's ops never ran
    assert all(p.rows == ROWS for k in layers[1:] for p in projections(k))


class Walk:
    """A walk kernel that runs the model's loop over each sequence of a step alone."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self,
        loop: LayerLoop,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        lora: LoraStep | None,
        layers: tuple[LayerKernels, ...],
    ) -> torch.Tensor:
        self.calls += 1
        out = torch.empty_like(h)
        start = 0
        for i, n in enumerate(attn.query_lens):
            one = AttentionMetadata(
                query_lens=[n], seq_lens=[attn.seq_lens[i]], seq_lens_t=attn.seq_lens_t[i : i + 1],
                slot_mapping=attn.slot_mapping[start : start + n], block_tables=attn.block_tables[i : i + 1],
                logits_indices=attn.logits_indices[:0],
            )  # fmt: skip
            rows = slice(start, start + n)
            out[rows] = loop(h[rows], cos[rows], sin[rows], one, kv_caches, lora, layers)
            start += n
        return out


def test_a_walk_kernel_runs_the_models_loop_with_the_bound_layers_and_its_rows_reach_the_head(
    checkpoint: Checkpoint,
) -> None:
    model = load_model(checkpoint.path, dtype="float32").model  # float32: one sequence alone sums alike
    walk = Walk()
    layers = tuple(recorded(layer) for layer in model.layers)
    got = logits(model, ModelKernels(layers, walk=walk))
    want = logits(model, None)
    assert walk.calls == len(STEPS)
    assert all(torch.allclose(g, w, rtol=1e-4, atol=1e-4) for g, w in zip(got, want, strict=True))
    # The loop ran once per sequence, on the layers it was given.
    assert all(p.rows == [len(PROMPT), 5, 1, 1] for k in layers for p in projections(k))
