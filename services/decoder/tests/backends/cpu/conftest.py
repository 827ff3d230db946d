"""Every kernel test runs once per build of the C kernels that this machine's CPU can run.

An AVX-512 machine runs the x86_64, avx2 and avx512 builds, so the lower levels' code paths are
tested there too; each level's torch custom ops live in their own namespace (`ops.register`).
"""

from __future__ import annotations

from typing import Any

import pytest

from tandem.decoder.backends.cpu import isa
from tandem.decoder.backends.cpu import ops as cpu_ops
from tandem.decoder.backends.cpu.build import Level
from tandem.decoder.backends.cpu.kernels import Kernels, KernelsUnavailable, load


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
