"""What this CPU can run: its model name, its ISA flags, and the highest kernel build level they allow.

Read once per process from /proc/cpuinfo (Linux x86 names the flags there; aarch64 lists
"Features" and no model name). Where it cannot be read, the lowest level of the architecture: a
build the CPU might not run is never chosen on a guess.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tandem.decoder.backends.cpu.build import Level, levels_for


@dataclass(frozen=True)
class CpuInfo:
    machine: str  # platform.machine(): "x86_64", "aarch64", ...
    model_name: str  # "AMD EPYC 9B45", or the machine name where /proc/cpuinfo has none
    flags: frozenset[str]  # ISA flags ("avx2", "avx512_bf16", "amx_bf16", ... or aarch64 "Features")

    @property
    def isa_summary(self) -> str:
        """The flags that decide kernel choices, for logs and benchmark records."""
        wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "avx_vnni")
        wanted += ("asimd", "sve")
        return " ".join(flag for flag in wanted if flag in self.flags) or "none of avx2/avx512/amx"


def parse_cpuinfo(text: str, machine: str) -> CpuInfo:
    """The first processor's model name and flags from /proc/cpuinfo's text."""
    model_name, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model_name:
            model_name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return CpuInfo(machine, model_name or machine, flags)


@cache
def this_cpu() -> CpuInfo:
    machine = platform.machine()
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text(), machine)
    except OSError:
        return CpuInfo(machine, platform.processor() or machine, frozenset())


def runnable_levels(cpu: CpuInfo) -> tuple[Level, ...]:
    """The builds of this architecture that the CPU can run, lowest first (never empty)."""
    levels = levels_for(cpu.machine)
    return tuple(level for level in levels if level.cpu_flags <= cpu.flags) or levels[:1]


def best_level(cpu: CpuInfo) -> Level:
    return runnable_levels(cpu)[-1]
