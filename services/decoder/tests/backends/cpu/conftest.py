"""Every kernel test runs once per build of the C kernels that this machine's CPU can run.

An AVX-512 machine runs the x86_64, avx2 and avx512 builds, so the lower levels' code paths are
tested there too; each level's torch custom ops live in their own namespace (`ops.register`).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.decoder.backends.cpu import isa
from tandem.decoder.backends.cpu import ops as cpu_ops
from tandem.decoder.backends.cpu.build import SOURCES, X86_64_LEVELS, Level, compile_command
from tandem.decoder.backends.cpu.kernels import Kernels, KernelsUnavailable, load
from tandem.decoder.models.loader import load_model

from ...conftest import Checkpoint

TILE_EMULATION = Path(__file__).with_name("tile_emulation.h")


@pytest.fixture(
    scope="session",
    params=isa.runnable_levels(isa.this_cpu()),
    ids=lambda level: level.name,
)
def kernels(request: pytest.FixtureRequest) -> Kernels:
    """One build of the C kernels, loaded once for the session (built by `pip install -e .`)."""
    level: Level = request.param
    try:
        return load(level)
    except KernelsUnavailable as error:
        pytest.fail(f"the {level.name} build of the C kernels must load on the test machine: {error}")


@pytest.fixture(scope="session")
def ops(kernels: Kernels) -> Any:
    """That build's custom ops, `torch.ops.tandem_<level>`."""
    return cpu_ops.register(kernels)


@pytest.fixture(scope="session")
def emulated_tiles(tmp_path_factory: pytest.TempPathFactory) -> Kernels:
    """The avx512bf16 level built with `tile_emulation.h`: the amx build's tile code (bf16 and int8),
    each tile instruction done in C and every shape the hardware would fault on checked, on any
    AVX512-BF16 CPU. Built once for the session."""
    if "avx512_bf16" not in isa.this_cpu().flags or shutil.which("cc") is None:
        pytest.skip("the emulated tiles build on the avx512bf16 level: needs avx512_bf16 and a C compiler")
    level = next(level for level in X86_64_LEVELS if level.name == "avx512bf16")
    folder = tmp_path_factory.mktemp("tiles")
    output = folder / "emulated_tiles.so"
    # Each source compiled alone (-c), all at once, then linked: one compiler process over every source
    # left every core but one idle. The library is the same, as no build links with link-time optimisation.
    extra = ("-O1", "-include", str(TILE_EMULATION), "-c")
    objects = {source: folder / f"{source}.o" for source in SOURCES}
    compiles = [
        subprocess.Popen(compile_command("cc", level, out, extra, (source,)), stderr=subprocess.PIPE)
        for source, out in objects.items()
    ]
    for process in compiles:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr.decode()
    link = ["cc", "-shared", "-fopenmp", "-o", str(output), *(str(out) for out in objects.values())]
    linked = subprocess.run(link, capture_output=True, text=True, timeout=60)
    assert linked.returncode == 0, linked.stderr
    kernels = Kernels(ctypes.CDLL(str(output)), level, output)
    assert kernels.tiles  # the emulation grants the tile state as a kernel would
    return kernels


def emulated_tile_products(kernels: Kernels) -> int | None:
    """The emulated build's count of tile products (TDPBF16PS and TDPBSUD) run so far; None on the
    hardware."""
    try:
        return ctypes.c_long.in_dll(ctypes.CDLL(str(kernels.path)), "tandem_emulated_tile_products").value
    except ValueError:
        return None


def amx_kernels(flags: set[str]) -> Kernels:
    """The amx build on a CPU whose /proc/cpuinfo has `flags` and whose kernel grants the tile state;
    elsewhere the test skips, saying what is missing."""
    missing = sorted(flags - isa.this_cpu().flags)
    if missing:
        pytest.skip(f"no {' or '.join(missing)} in /proc/cpuinfo: AMX tiles cannot run on this CPU")
    level = next(level for level in X86_64_LEVELS if level.name == "amx")
    try:
        kernels = load(level)
    except KernelsUnavailable as error:
        pytest.fail(f"the amx build must load on a CPU with AMX: {error}")
    if not kernels.tiles:
        pytest.skip("the kernel refused this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
    return kernels


@pytest.fixture
def bf16_model(checkpoint: Checkpoint) -> torch.nn.Module:
    """The test checkpoint in bf16, the model whose linears the kernel choice times (kernel_choice,
    kernel_cache, int8_tile_choice's tests)."""
    return load_model(checkpoint.path, dtype="bfloat16").model
