"""How the C kernels are compiled: one shared library per ISA level, built when the project is installed.

Standard library only: `setup.py` runs this at `pip install` time (in pip's isolated build
environment, which has no torch). A service never compiles: it loads the build for its CPU's level
(`kernels.py`). Every build has -Wall -Wextra, never -Werror (a user's newer compiler with a new
warning must not fail their install), and leaves what the compiler said in a record beside the library
(`BuildRecord`): the tests check the installed levels warning-free from it, and compile again only a
level whose record is missing or speaks for another build.

Why several levels: `-march=native` bakes the build machine's CPU into the code, so one image could
not serve another CPU, and a build for the lowest common level leaves AVX2 and AVX-512 unused. Each
level is a named baseline (x86-64 psABI levels), and `isa.py` picks the highest one the running CPU
has. The sources choose their vector paths from the compiler's macros (`__AVX2__`, `__FMA__`), so a
level gets exactly the code its baseline allows.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
# One library. A file may call another's exported functions, never in a circle (layer.c the fused
# layer's parts, attention.c the tiled attention, both attentions the run finder): test_build checks.
SOURCES = (
    "argmax.c",
    "attention.c",
    "attention_tiles.c",
    "copy_digest.c",
    "limits.c",
    "linear.c",
    "linear_f32.c",
    "linear_int8.c",
    "linear_packed.c",
    "linear_quant.c",
    "linear_tiles.c",
    "layer.c",
    "lora.c",
    "quant_rows.c",
    "runs.c",
)
HEADERS = (
    "bf16.h", "elements.h", "exp.h", "limits.h", "lora.h", "runs.h", "scratch.h", "team.h", "tiles.h",
    "weight.h",
)  # fmt: skip
PACKAGE = "tandem.decoder.backends.cpu"  # where the libraries are installed, as extension modules

# -fopenmp: the library's parallel loops join torch's OpenMP runtime (torch/lib/libgomp.so.1, already
# loaded by then). No -ffast-math: it would also set flush-to-zero for the whole process on load, and
# it would let the compiler reorder sums (each output row's summation order is a promise). -std=c11
# keeps floating-point contraction off, so only the written-out FMAs fuse.
COMMON_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-std=c11")
# They change no code, only what the compiler says; in the build id all the same, so that a record
# made under fewer warnings is stale once more are asked for.
WARNING_FLAGS = ("-Wall", "-Wextra")


@dataclass(frozen=True)
class Level:
    """One build of the library."""

    name: str  # "x86_64", "avx2", "avx512", "avx512bf16", "amx", "aarch64" or "generic": the library's suffix
    machine_flags: tuple[str, ...]  # the compiler's target flags for this baseline
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags a CPU needs to run it (x86-64 psABI level)


_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
X86_64_LEVELS = (
    Level("x86_64", ("-march=x86-64", "-mtune=generic"), frozenset()),
    Level("avx2", ("-march=x86-64-v3", "-mtune=generic"), _V3),
    Level("avx512", ("-march=x86-64-v4", "-mtune=generic"), _V4),
    # AVX512-BF16's dot product (Zen 4 and 5, Cooper Lake, Sapphire Rapids on): the packed linears;
    # and AVX512-VNNI's byte dot product, which every CPU with AVX512-BF16 has: int8 activations
    # (linear_int8.c).
    Level(
        "avx512bf16",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=generic"),
        _V4 | {"avx512_bf16", "avx512_vnni"},
    ),
    # AMX tiles on top (Sapphire Rapids on): TDPBF16PS linears (linear_tiles.c) where the measured
    # choice binds them; the tile state also needs the kernel's permission, asked at load (Kernels.tiles).
    Level(
        "amx",
        (
            "-march=x86-64-v4",
            "-mavx512bf16",
            "-mavx512vnni",
            "-mamx-tile",
            "-mamx-bf16",
            "-mamx-int8",
            "-mtune=generic",
        ),
        _V4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"},
    ),
)
AARCH64_LEVELS = (Level("aarch64", ("-march=armv8-a",), frozenset()),)
GENERIC_LEVELS = (Level("generic", (), frozenset()),)  # any other machine: the compiler's default target


def levels_for(machine: str) -> tuple[Level, ...]:
    """The builds made for a machine (`platform.machine()`), lowest first."""
    machine = machine.lower()
    if machine in ("x86_64", "amd64"):
        return X86_64_LEVELS
    if machine in ("aarch64", "arm64"):
        return AARCH64_LEVELS
    return GENERIC_LEVELS


def module_name(level: Level) -> str:
    """The library's module name: `_kernels_<level>` (it is loaded with ctypes, never imported)."""
    return f"_kernels_{level.name}"


def build_id(level: Level) -> str:
    """What a library must report (`tandem_build_id()`) to be loaded: a digest of the sources, the
    headers and the level's flags. A library built from other sources (an install older than the
    checkout) is refused rather than run."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode() + b"\0" + (CSRC / name).read_bytes() + b"\0")
    digest.update(" ".join((*COMMON_FLAGS, *WARNING_FLAGS, *level.machine_flags)).encode())
    return digest.hexdigest()[:16]


def compile_command(
    compiler: str,
    level: Level,
    output: Path,
    extra: tuple[str, ...] = (),
    sources: tuple[str, ...] = SOURCES,  # one source with extra ("-c",): that file's object alone
) -> list[str]:
    return [
        compiler,
        *COMMON_FLAGS,
        *WARNING_FLAGS,
        *level.machine_flags,
        f'-DTANDEM_BUILD_ID="{build_id(level)}"',
        *extra,
        "-o",
        str(output),
        *(str(CSRC / source) for source in sources),
    ]


def compile_level(compiler: str, level: Level, output: Path, extra: tuple[str, ...] = ()) -> str:
    """Builds one level's library at `output` and returns the compiler's warnings ("" for none);
    RuntimeError with the compiler's output on failure."""
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    command = compile_command(compiler, level, output, extra)
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
    return result.stderr


@dataclass(frozen=True)
class BuildRecord:
    """What the compiler said when it built one installed library, kept beside it (`record_path`). Its
    other fields name exactly which build that was, so a record never speaks for another library."""

    build_id: str  # the library's tandem_build_id(): its sources, headers and flags
    compiler: str  # the first line of the compiler's `--version`: a newer one may warn where it did not
    library_sha256: str  # the file it was built as: a library rebuilt without its record makes it stale
    warnings: str  # the compiler's output, with WARNING_FLAGS: "" for a clean build

    def describes(self, level: Level, compiler: str, library: Path) -> bool:
        """Whether this is the record of `library`, built from these sources by this `compiler`."""
        return (self.build_id, self.compiler, self.library_sha256) == (
            build_id(level),
            compiler_version(compiler),
            file_sha256(library),
        )


def compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    return result.stdout.partition("\n")[0]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_path(library: Path) -> Path:
    return library.with_name(f"{library.name}.build.json")


def build_installed(compiler: str, level: Level, output: Path) -> BuildRecord:
    """Builds one level's library at `output` (the install's build) and writes its record beside it."""
    record_path(output).unlink(missing_ok=True)  # a failed build leaves no record of an older one
    warnings = compile_level(compiler, level, output)
    record = BuildRecord(build_id(level), compiler_version(compiler), file_sha256(output), warnings)
    record_path(output).write_text(json.dumps(asdict(record), indent=1) + "\n")
    return record


def read_record(library: Path) -> BuildRecord | None:
    """The record beside `library`; None when there is none (built before records, or by hand)."""
    try:
        return BuildRecord(**json.loads(record_path(library).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def this_machine_levels() -> tuple[Level, ...]:
    return levels_for(platform.machine())
