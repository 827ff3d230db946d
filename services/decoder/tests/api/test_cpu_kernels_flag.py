"""`--cpu-kernels`: an unknown name, or a build this CPU cannot run, is one line naming the flag and
exit 2, before any weight is read or a port is opened."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.backends.cpu.isa import runnable_levels, this_cpu

PREFIX = "tandem serve decoder: --cpu-kernels (TANDEM_CPU_KERNELS)"


def test_an_unknown_build_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert decoder_main(["--cpu-kernels", "avx1024", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'avx1024' is not one of 'auto', 'x86_64', 'avx2', 'avx512'" in err


def test_a_build_this_cpu_cannot_run_says_what_it_needs(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runnable = [level.name for level in runnable_levels(this_cpu())]
    missing = next((name for name in ("amx", "avx512bf16", "avx512") if name not in runnable), None)
    if missing is None:
        pytest.skip("this CPU runs every x86 build")
    assert decoder_main(["--model", str(tiny_model_dir), "--port", "0", "--cpu-kernels", missing]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"{PREFIX}: {missing} cannot run on this CPU (it needs ")
    assert said.endswith(f"; it runs {', '.join(runnable)} (or auto)\n")
