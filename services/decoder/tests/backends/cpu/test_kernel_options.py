"""The kernel options as the engine's config builds them (backends/cpu/kernel_options.py)."""

from __future__ import annotations

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.backends.cpu.kernel_options import CPU_KERNELS
from tandem.decoder.config import EngineConfig

from ...conftest import Checkpoint


def test_an_unknown_build_is_refused_naming_the_choices(checkpoint: Checkpoint) -> None:
    with pytest.raises(ConfigError, match=r"^cpu_kernels must be one of \('auto', 'x86_64', "):
        EngineConfig(model_dir=checkpoint.path, cpu_kernels="avx1024")
    assert CPU_KERNELS[0] == "auto"
    options = EngineConfig(model_dir=checkpoint.path, batch_invariant=True).kernel_options
    assert options.cache_dir == checkpoint.path and not options.prefill_kernels and options.exact_rows == 68
