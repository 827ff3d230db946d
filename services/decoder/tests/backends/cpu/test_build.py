"""How the C kernels are built and loaded: every level compiles warning-free (as the install recorded
it, or built here), a library built from other sources is refused, a missing one leaves the model on
torch ops, and the CPU's flags pick the level."""

from __future__ import annotations

import graphlib
import logging
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tandem.decoder.backends.cpu import kernels as cpu_kernels
from tandem.decoder.backends.cpu.build import (
    AARCH64_LEVELS,
    CSRC,
    HEADERS,
    SOURCES,
    WARNING_FLAGS,
    X86_64_LEVELS,
    BuildRecord,
    Level,
    build_id,
    build_installed,
    compile_command,
    compile_level,
    file_sha256,
    read_record,
    this_machine_levels,
)
from tandem.decoder.backends.cpu.isa import CpuInfo, best_level, parse_cpuinfo, runnable_levels, this_cpu
from tandem.decoder.backends.cpu.kernels import Kernels, KernelsUnavailable

CROSS_AARCH64 = "aarch64-linux-gnu-gcc"
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler `cc` on PATH")


def installed_warnings(level: Level) -> str | None:
    """What `cc` said when the install built this level's library (build.py's record beside it), if
    that library is the build of these sources by this `cc`: it is the one that ships."""
    try:
        library = cpu_kernels.library_path(level)
    except KernelsUnavailable:
        return None
    record = read_record(library)
    return record.warnings if record is not None and record.describes(level, "cc", library) else None


@pytest.fixture(scope="module")
def warnings_by_level(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[str]]]:
    """What `cc` says building each level of this machine, at the flags that ship: the install's record
    where it describes these sources, otherwise (no install, an edited source, another `cc`) a build
    here, all started at once (each one compiler process over every source: about a minute for the
    avx512bf16 and amx levels on two cores, where reading the records takes milliseconds)."""
    folder = tmp_path_factory.mktemp("builds")

    def warnings(level: Level) -> str:
        installed = installed_warnings(level)
        return installed if installed is not None else compile_level("cc", level, folder / f"{level.name}.so")

    levels = this_machine_levels()
    with ThreadPoolExecutor(max_workers=len(levels)) as pool:
        yield {level.name: pool.submit(warnings, level) for level in levels}


@needs_cc
@pytest.mark.parametrize("level", this_machine_levels(), ids=lambda level: level.name)
def test_every_level_of_this_machine_compiles_without_a_warning(
    level: Level, warnings_by_level: dict[str, Future[str]]
) -> None:
    warnings = warnings_by_level[level.name].result()  # the compiler's output in a RuntimeError if it failed
    assert warnings == "", f"the {level.name} build, with {' '.join(WARNING_FLAGS)}:\n{warnings}"


@pytest.mark.skipif(shutil.which(CROSS_AARCH64) is None, reason=f"no {CROSS_AARCH64} on PATH")
@pytest.mark.parametrize("level", AARCH64_LEVELS, ids=lambda level: level.name)
def test_the_aarch64_level_cross_compiles_without_a_warning(level: Level, tmp_path: Path) -> None:
    assert compile_level(CROSS_AARCH64, level, tmp_path / f"{level.name}.so") == ""


def fake_compiler(tmp_path: Path, version: str, warning: str) -> str:
    """A `cc` that answers --version with `version`, and otherwise writes its -o file and warns."""
    script = tmp_path / "cc"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --version ]; then echo "{version}"; exit 0; fi\n'
        'while [ "$1" != -o ]; do shift; done; echo "$$" > "$2"\n'
        f"printf '%s' \"{warning}\" >&2\n"
    )
    script.chmod(0o755)
    return str(script)


def test_the_install_keeps_a_warning_in_the_libraries_record_rather_than_failing(tmp_path: Path) -> None:
    level = this_machine_levels()[0]
    compiler = fake_compiler(tmp_path, "cc 99", "lora.c:1: warning: unused variable 'x'")
    library = tmp_path / f"{level.name}.so"
    build_installed(compiler, level, library)
    assert read_record(library) == BuildRecord(
        build_id(level), "cc 99", file_sha256(library), "lora.c:1: warning: unused variable 'x'"
    )
    assert read_record(library).describes(level, compiler, library)


def test_a_record_describes_only_the_library_built_with_it_by_that_compiler(tmp_path: Path) -> None:
    level = this_machine_levels()[0]
    compiler = fake_compiler(tmp_path, "cc 99", "")
    library = tmp_path / f"{level.name}.so"
    build_installed(compiler, level, library)
    record = read_record(library)
    assert record is not None and record.warnings == ""
    assert not record.describes(Level(level.name, ("-mno-sse4",), level.cpu_flags), compiler, library)
    assert not record.describes(level, fake_compiler(tmp_path, "cc 100", ""), library)
    library.write_bytes(b"rebuilt without its record")
    assert not record.describes(level, compiler, library)
    assert read_record(tmp_path / "never-built.so") is None


def build_with_id(tmp_path: Path, level: Level, build: str | None) -> Path:
    """This level's library at -O0 (the flags that make its build id stay), reporting `build` if given."""
    output = tmp_path / f"_kernels_{level.name}.so"
    relabel = ("-UTANDEM_BUILD_ID", f'-DTANDEM_BUILD_ID="{build}"') if build is not None else ()
    compile_level("cc", level, output, extra=("-O0", *relabel))
    return output


@needs_cc
def test_load_takes_a_library_built_from_these_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    level = runnable_levels(this_cpu())[0]
    library = build_with_id(tmp_path, level, None)
    monkeypatch.setattr(cpu_kernels, "library_path", lambda _: library)
    loaded = cpu_kernels.load.__wrapped__(level)
    assert isinstance(loaded, Kernels) and loaded.level == level and loaded.path == library


@needs_cc
def test_load_refuses_a_library_built_from_other_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    level = runnable_levels(this_cpu())[0]
    other = "0123456789abcdef"
    assert other != build_id(level)
    library = build_with_id(tmp_path, level, other)
    monkeypatch.setattr(cpu_kernels, "library_path", lambda _: library)
    with pytest.raises(KernelsUnavailable, match=f"built from other sources \\(build {other}, sources"):
        cpu_kernels.load.__wrapped__(level)


def test_without_a_library_load_for_cpu_logs_one_warning_and_returns_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def missing(level: Level) -> Path:
        raise KernelsUnavailable(f"no {level.name} build of the CPU kernels")

    monkeypatch.setattr(cpu_kernels, "library_path", missing)
    monkeypatch.setattr(cpu_kernels, "load", cpu_kernels.load.__wrapped__)  # past the per-process cache
    cpu = CpuInfo("x86_64", "test CPU", frozenset())
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load_for_cpu.__wrapped__(cpu) is None
    assert [record.getMessage() for record in caplog.records] == [
        "CPU kernels unavailable, the model runs on torch ops: no x86_64 build of the CPU kernels"
    ]


# -- which source calls which ----------------------------------------------------------------------


def calls_between_sources(level: Level, tmp_path: Path) -> dict[str, set[str]]:
    """For each source, the other sources whose functions its object calls: each file compiled alone by
    build.py's command (-c), its undefined symbols (`nm`) matched to the others' defined ones. At -O0,
    where no call is optimised away, so every call any build makes is there (files never inline each
    other: there is no link-time optimisation)."""
    objects = {source: tmp_path / f"{source}.o" for source in SOURCES}
    compiles = [
        subprocess.Popen(compile_command("cc", level, out, ("-c", "-O0"), (source,)), stderr=subprocess.PIPE)
        for source, out in objects.items()
    ]
    for process in compiles:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr.decode()
    defined, undefined = {}, {}
    for source, out in objects.items():
        listing = subprocess.run(["nm", "-g", "-P", str(out)], capture_output=True, text=True, check=True)
        rows = [line.split()[:2] for line in listing.stdout.splitlines()]
        defined[source] = {name for name, kind in rows if kind != "U"}
        undefined[source] = {name for name, kind in rows if kind == "U"}
    return {
        source: {other for other in SOURCES if other != source and undefined[source] & defined[other]}
        for source in SOURCES
    }


@needs_cc
@pytest.mark.skipif(shutil.which("nm") is None, reason="no `nm` on PATH")
@pytest.mark.parametrize(
    "level",
    # The lowest and the highest level: the code each #if keeps differs most between them.
    dict.fromkeys((this_machine_levels()[0], this_machine_levels()[-1])),
    ids=lambda level: level.name,
)
def test_no_source_calls_back_into_a_file_that_calls_it(level: Level, tmp_path: Path) -> None:
    calls = calls_between_sources(level, tmp_path)
    # What the library is built as: layer.c chains the others' kernels, attention.c hands bf16 caches
    # to the tiled kernel (a stub below AVX512-BF16), and both attentions share the run finder.
    assert {"attention.c", "linear_quant.c", "lora.c"} <= calls["layer.c"]
    assert {"attention_tiles.c", "runs.c"} <= calls["attention.c"]
    try:
        tuple(graphlib.TopologicalSorter(calls).static_order())
    except graphlib.CycleError as error:
        pytest.fail(f"the sources call each other in a circle: {' -> '.join(error.args[1])}")


# -- isa.py ----------------------------------------------------------------------------------------

X86_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) CPU E5-2690 v4 @ 2.60GHz
flags\t\t: fpu sse2 avx avx2 fma bmi1 bmi2

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: some other name
flags\t\t: fpu
"""

AARCH64_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm sve
CPU implementer\t: 0x41
CPU architecture: 8

processor\t: 1
Features\t: fp
"""

# An AVX2-only CPU's flags (Haswell), and an AVX-512 one's (Skylake-SP).
AVX2_FLAGS = frozenset(
    "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 bmi1 bmi2 f16c fma abm movbe xsave aes".split()
)
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def test_the_build_id_covers_every_file_of_csrc() -> None:
    # build_id digests SOURCES and HEADERS only: a file of csrc/ missing from them would change no id,
    # so an edit to it alone would leave an old library loaded and its clean warnings record trusted.
    on_disk = {path.name for path in CSRC.iterdir() if path.is_file()}
    assert on_disk == set(SOURCES) | set(HEADERS)


def test_parse_cpuinfo_of_x86_takes_the_first_processors_model_name_and_flags() -> None:
    cpu = parse_cpuinfo(X86_CPUINFO, "x86_64")
    assert cpu.machine == "x86_64"
    assert cpu.model_name == "Intel(R) Xeon(R) CPU E5-2690 v4 @ 2.60GHz"
    assert cpu.flags == {"fpu", "sse2", "avx", "avx2", "fma", "bmi1", "bmi2"}


def test_parse_cpuinfo_of_aarch64_names_the_machine_and_reads_the_features() -> None:
    cpu = parse_cpuinfo(AARCH64_CPUINFO, "aarch64")
    assert cpu.model_name == "aarch64"  # no "model name" line
    assert {"fp", "asimd", "sve"} <= cpu.flags and "fphp" in cpu.flags
    assert cpu.isa_summary == "asimd sve"


@pytest.mark.parametrize(
    ("machine", "flags", "best"),
    [
        ("x86_64", AVX2_FLAGS, "avx2"),
        ("x86_64", AVX512_FLAGS, "avx512"),
        ("x86_64", AVX512_FLAGS | {"avx512_bf16", "avx512_vnni"}, "avx512bf16"),
        ("x86_64", AVX512_FLAGS | {"avx512_bf16"}, "avx512"),  # the build's int8 products need VNNI too
        (
            "x86_64",
            AVX512_FLAGS | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"},
            "amx",
        ),  # Sapphire Rapids on
        (
            "x86_64",
            AVX512_FLAGS | {"avx512_bf16", "avx512_vnni", "amx_tile"},
            "avx512bf16",
        ),  # tiles, no bf16 product
        ("x86_64", AVX512_FLAGS - {"avx512vl"}, "avx2"),  # AVX-512 without all of x86-64-v4
        ("x86_64", AVX2_FLAGS - {"movbe"}, "x86_64"),  # AVX2 without all of x86-64-v3
        ("x86_64", frozenset(), "x86_64"),  # flags unknown: the lowest level, never a guess
        ("aarch64", frozenset({"fp", "asimd"}), "aarch64"),
        ("aarch64", frozenset(), "aarch64"),
        ("riscv64", frozenset(), "generic"),
    ],
)
def test_the_best_level_is_the_highest_one_the_cpus_flags_allow(
    machine: str, flags: frozenset[str], best: str
) -> None:
    cpu = CpuInfo(machine, "test CPU", flags)
    levels = runnable_levels(cpu)
    assert best_level(cpu).name == best == levels[-1].name
    if machine == "x86_64":  # every level up to the best, lowest first
        assert levels == X86_64_LEVELS[: [level.name for level in X86_64_LEVELS].index(best) + 1]
