"""The backend switch: what each --device means, how a missing SDK or GPU fails, rank-free slicing.

CUDA never runs here (no GPU), and this environment has no torch_xla (the Neuron backend's tests run
in .venv-xla: tests/xla/). These tests pin what can be checked without either: the table, the start-up
errors, the config rules, and sequence windows that one traced graph serves for every rank.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tandem.decoder.api.main import config_from_args, main
from tandem.decoder.backends import backend as backends
from tandem.decoder.backends.backend import BACKENDS, BackendUnavailable
from tandem.decoder.backends.cpu.attention import CpuPagedAttention
from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.isa import best_level, this_cpu
from tandem.decoder.backends.cpu.kernels import load_for_cpu
from tandem.decoder.backends.xla import runtime as xla_runtime
from tandem.decoder.config import DecoderConfig, EngineConfig
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.models.tensor_parallel import window_rows

# oneDNN's packed bf16 linears need its bf16 path (AVX512-BW/VL/DQ or AVX-NE-CONVERT); else the C kernel.
ONEDNN_BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())

HAS_XLA = xla_runtime.is_installed()


def test_each_backend_states_its_placement_dtype_collectives_and_compiler() -> None:
    cpu, cuda, neuron = BACKENDS["cpu"], BACKENDS["cuda"], BACKENDS["neuron"]
    assert (cpu.collective_backend, cuda.collective_backend, neuron.collective_backend) == (
        "gloo",
        "nccl",
        None,
    )
    assert {b.default_dtype for b in BACKENDS.values()} == {"bfloat16"}
    assert cuda.uses_cuda_graphs and cuda.compile_mode == "reduce-overhead"
    assert neuron.requires_static_shapes and neuron.compile_mode is None  # XLA graphs, not torch.compile
    assert neuron.placement == "xla" and neuron.is_spmd and not cpu.is_spmd and not cuda.is_spmd
    assert not cpu.requires_static_shapes and not cuda.requires_static_shapes


@pytest.mark.parametrize(
    ("device", "name"), [("cpu", "cpu"), ("cuda", "cuda"), ("cuda:3", "cuda"), ("neuron", "neuron")]
)
def test_device_values_resolve_without_importing_any_sdk(device: str, name: str) -> None:
    assert backends.resolve(device).name == name


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:1", "neuron:0", ""])
def test_unknown_devices_are_refused_naming_the_choices(device: str) -> None:
    with pytest.raises(ValueError, match=r"device must be one of cpu, cuda, neuron"):
        backends.resolve(device)


def test_cpu_and_cuda_place_weights_on_their_device_and_cuda_keeps_its_index() -> None:
    assert backends.start_device("cuda:1") == torch.device("cuda:1")
    assert backends.start_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed here")
def test_neuron_without_torch_xla_fails_at_start_saying_what_to_install(
    capsys: pytest.CaptureFixture, environ
) -> None:
    with pytest.raises(BackendUnavailable, match=r"torch_xla is not installed"):
        backends.check_available("neuron")
    assert main(["--device", "neuron", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "make setup-xla" in err and "torch-xla 2.9.0" in err and "pip.repos.neuron.amazonaws.com" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available here")
def test_cuda_without_a_gpu_fails_at_start_saying_what_to_install(
    capsys: pytest.CaptureFixture, environ
) -> None:
    with pytest.raises(BackendUnavailable, match="sees no CUDA device"):
        backends.check_available("cuda")
    assert main(["--device", "cuda", "--port", "0"]) == 2
    assert "install a CUDA build of torch" in capsys.readouterr().err


def test_device_flag_and_variable_pick_the_backend_defaults(environ) -> None:
    neuron = config_from_args(["--device", "neuron"])
    assert (neuron.engine.device, neuron.engine.dtype) == ("neuron", "bfloat16")
    # --world-size on neuron counts devices of one SPMD program in this process, not ranks.
    assert config_from_args(["--device", "neuron", "--world-size", "4"]).engine.num_devices == 4
    assert neuron.engine.static_shapes and neuron.engine.compile  # Neuron: static and traced by default
    assert not config_from_args([]).engine.compile
    environ({"TANDEM_DEVICE": "cpu", "TANDEM_COMPILE": "true", "TANDEM_STATIC_SHAPES": "1"})
    cpu = config_from_args([])
    assert cpu.engine.compile and cpu.engine.static_shapes and cpu.engine.dtype == "bfloat16"


def test_config_refuses_combinations_a_backend_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="device neuron runs static shapes only"):
        EngineConfig(model_dir=tmp_path, device="neuron")
    with pytest.raises(ValueError, match="compile needs static_shapes"):
        EngineConfig(model_dir=tmp_path, compile=True)
    neuron = EngineConfig(model_dir=tmp_path, device="neuron", static_shapes=True, compile=True)
    with pytest.raises(ValueError, match="world_size is 2 but the engine spans 1 neuron devices"):
        DecoderConfig(engine=neuron, world_size=2)
    with pytest.raises(ValueError, match=r"num_devices must be 1 on cpu"):
        EngineConfig(model_dir=tmp_path, num_devices=2)
    compiled = EngineConfig(model_dir=tmp_path, static_shapes=True, compile=True)
    with pytest.raises(ValueError, match="world_size must be 1: compile runs on one rank only"):
        DecoderConfig(engine=compiled, world_size=2)


def test_one_traced_window_graph_serves_every_rank() -> None:
    class Window(torch.nn.Module):
        def forward(self, x: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
            return window_rows(x, rank, 4)

    x = torch.arange(24.0).view(12, 2)  # [num_tokens, hidden]
    graph = torch.export.export(Window(), (x, torch.tensor(0))).module()  # traced once, at rank 0
    for rank in range(4):
        assert torch.equal(graph(x, torch.tensor(rank)), x[rank * 3 : (rank + 1) * 3])


def test_an_engine_runs_the_bf16_model_it_loads_on_the_cpu_executor_but_a_callers_as_given(
    tiny_model_dir,
) -> None:
    from tandem.decoder.config import EngineConfig
    from tandem.decoder.models.loader import load_model

    config = EngineConfig(model_dir=tiny_model_dir, dtype="bfloat16", num_kv_blocks=16)
    engine = Engine(config)
    try:
        assert isinstance(engine.executor, CpuExecutor)
        kernels = load_for_cpu()
        packed = kernels is not None and kernels.weight_layout != 0  # AVX512-BF16: the packed C linears
        assert engine.executor.choice.linears == ("onednn" if ONEDNN_BF16 and not packed else "c")
        assert engine.core.runner.executor is engine.executor
    finally:
        engine.shutdown()
    given = load_model(tiny_model_dir, dtype="bfloat16")
    engine = Engine(config, given)
    try:
        assert engine.executor is given.model
    finally:
        engine.shutdown()


def test_an_engine_on_cpu_runs_its_model_on_the_c_kernels_unless_told_not_to(tiny_model_dir) -> None:
    from tandem.decoder.config import EngineConfig

    spec = GenerateSpec(
        [[5, 6, 7, 8]], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=6, ignore_eos=True)
    )
    outputs = {}
    for use_kernels in (True, False):
        config = EngineConfig(
            model_dir=tiny_model_dir, dtype="float32", num_kv_blocks=16, native_kernels=use_kernels
        )
        with Engine(config) as engine:
            attention = engine.loaded.model.layers[0].self_attn.attention
            assert isinstance(attention, CpuPagedAttention) is use_kernels
            events = list(engine.generate(spec))
            outputs[use_kernels] = [t for e in events if isinstance(e, Delta) for t in e.token_ids]
    assert len(outputs[True]) == 6
    assert outputs[True] == outputs[False]  # fp32: the same greedy tokens either way


@pytest.mark.parametrize(
    ("compile", "native_kernels", "on_executor", "said"),
    [
        (False, True, True, "CPU "),
        (False, False, False, "CPU kernels: off (--native-kernels false), the model runs on torch ops"),
        (True, True, False, "CPU kernels: not used in compiled mode"),
    ],
)
def test_prepare_model_binds_the_cpu_executor_for_eager_cpu_only_and_says_so(
    tiny_model_dir,
    compile: bool,
    native_kernels: bool,
    on_executor: bool,
    said: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # What rank 0's engine and every other rank's worker do with the model they load.
    from tandem.decoder.models.loader import load_model

    model = load_model(tiny_model_dir, dtype="bfloat16").model
    with caplog.at_level(logging.INFO, logger="tandem.decoder.backends"):
        step = backends.prepare_model(model, BACKENDS["cpu"], compile, native_kernels)
    assert isinstance(step, CpuExecutor) is on_executor
    assert (step is model) is not on_executor
    assert isinstance(model.layers[0].self_attn.attention, CpuPagedAttention) is on_executor
    if on_executor:
        # One line says what was chosen: the CPU, its ISA flags, the build, linears and layer paths.
        assert_one_line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU ")]
        assert assert_one_line == [step.choice.describe()]
        assert step.choice.build == best_level(this_cpu()).name
        return
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU kernels")][0].startswith(
        said
    )
