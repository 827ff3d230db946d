"""The CUDA backend's attention path, run on CPU: the engine with FlexPagedAttention gives the CPU tokens.

`CudaPagedAttention` is FlexPagedAttention over FlexAttention compiled to Triton, which needs a GPU
(tests/gpu runs it). Here the same class runs FlexAttention's eager path in the CPU engine, dynamic
and in compiled static-shape decode buckets: dynamo traces the decode step whole, block-mask
building included, as the CUDA backend's graphs need, and the tokens match the default CPU engine's.
"""

from __future__ import annotations

import dataclasses
import queue
from pathlib import Path

import pytest
import torch

from tandem.decoder.backends import backend as backends
from tandem.decoder.backends.backend import BACKENDS, Backend
from tandem.decoder.backends.cuda_attention import CudaPagedAttention
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import EmbeddingPrompt, GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta, Event, Failed, Finished
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.models.flex_attention import FlexPagedAttention
from tandem.decoder.models.loader import LoadedModel, load_model

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# The CPU backend with the CUDA backend's attention code; "aot_eager" compiles the same graphs.
FLEX_ON_CPU: Backend = dataclasses.replace(
    BACKENDS["cpu"], attention=FlexPagedAttention, compiler="aot_eager"
)
SETTINGS = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=3, max_model_len=32)


def _specs(hidden_size: int) -> list[GenerateSpec]:
    """A token prompt, an embedding prompt and a mixed one, greedy."""
    gen = torch.Generator().manual_seed(0)
    rows = EmbeddingPrompt(torch.randn(3, hidden_size, generator=gen))
    stopping = StoppingParams(max_new_tokens=6, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0)
    prompts = [[[11, 12, 13, 14, 15, 16, 17]], [rows], [[21, 22], rows, [23]]]
    return [GenerateSpec(prompt, greedy, stopping) for prompt in prompts]


def _tokens(engine: Engine) -> list[list[int]]:
    """Each spec alone, then all of them submitted together (one batch, ragged lengths)."""
    specs = _specs(engine.model_config.hidden_size)
    alone = [[t for e in engine.generate(s) if isinstance(e, Delta) for t in e.token_ids] for s in specs]
    queues: list[queue.SimpleQueue[Event]] = [queue.SimpleQueue() for _ in specs]
    for spec, events in zip(specs, queues, strict=True):
        engine.submit(spec, events.put)
    together = []
    for events in queues:
        tokens: list[int] = []
        while not isinstance(event := events.get(timeout=120), Finished | Failed):
            tokens += event.token_ids if isinstance(event, Delta) else []
        assert isinstance(event, Finished), event
        together.append(tokens)
    assert together == alone
    return alone


def test_the_cuda_backend_attends_through_flexattention_and_checks_its_block_size(tmp_path: Path) -> None:
    assert BACKENDS["cuda"].attention is CudaPagedAttention
    assert issubclass(CudaPagedAttention, FlexPagedAttention)
    with pytest.raises(
        ValueError, match=r"block_size must be a power of two >= 16 for FlexAttention \(cuda\), got 8"
    ):
        EngineConfig(model_dir=tmp_path, device="cuda", block_size=8)
    assert EngineConfig(model_dir=tmp_path, device="cpu", block_size=8).block_size == 8  # torch ops: any


def test_prepare_model_gives_every_layer_the_backends_attention(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype="float32").model
    backends.prepare_model(model, FLEX_ON_CPU, compile=False, native_kernels=False)
    implementations = {id(layer.self_attn.attention) for layer in model.layers}
    assert len(implementations) == 1  # one instance: layers share each step's block masks
    assert isinstance(model.layers[0].self_attn.attention, FlexPagedAttention)


def test_an_engine_with_flex_attention_gives_the_cpu_engines_tokens(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    with Engine(EngineConfig(model_dir=tiny_model_dir, **SETTINGS)) as engine:
        expected = _tokens(engine)
    flex_model = load_model(tiny_model_dir, dtype="float32")
    backends.prepare_model(flex_model.model, FLEX_ON_CPU, compile=False, native_kernels=False)
    with Engine(EngineConfig(model_dir=tiny_model_dir, **SETTINGS), flex_model) as engine:
        assert _tokens(engine) == expected


def test_compiled_decode_buckets_trace_the_flex_path_whole_and_give_the_eager_tokens(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    # One sequence bucket (every decode step pads to 4 rows, a lone request beside 3 padding rows) at
    # both block-table widths: two graphs, each traced whole; more sequence buckets trace the same code.
    static = dict(
        static_shapes=True,
        max_num_batched_tokens=16,
        seq_buckets=(4,),
        token_buckets=(1, 4, 8, 32),
        block_table_buckets=(2, 8),
    )
    with Engine(EngineConfig(model_dir=tiny_model_dir, **SETTINGS)) as engine:
        expected = _tokens(engine)
    config = EngineConfig(model_dir=tiny_model_dir, **SETTINGS, **static, compile=True)
    with Engine(config, backend=FLEX_ON_CPU) as engine:
        compiler = engine.core.runner.compiler
        assert compiler is not None and compiler.num_graphs == 2  # fullgraph: one per decode bucket
        calls_after_warmup = compiler.num_calls
        assert _tokens(engine) == expected
        assert compiler.num_graphs == 2
        assert compiler.num_calls > calls_after_warmup  # decode steps ran the traced graphs
