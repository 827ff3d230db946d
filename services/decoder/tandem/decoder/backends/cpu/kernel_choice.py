"""Which kernel runs each bf16 linear, chosen by timing the candidates on this CPU at load.

NOTE: the rule. A CPU's flags say which builds may run (`isa.py`); which is fastest is measured. For
the model's real linear shapes and the row counts the engine will call them with, every candidate
this CPU runs is timed (interleaved, best of a few) and the fastest bound, under one constraint: a
row's bits must not depend on how many rows share its call, for every call a decode or verify step
can make. So:

- rows below `prefill_rows` (every step without prompt positions fits: decode, speculation's
  verification, batched decode): one exact kernel per shape for all of them, the one whose times
  over the row buckets are best on the whole (geometric mean against each bucket's fastest). Exact
  kernels keep a row's summation order whatever the row count: the C builds' own ("amx" tiles,
  "avx512bf16", "avx512", "avx2", "x86_64"). Kernels of different builds cannot share a step (a
  fused layer is one library's), so one build is chosen for the model and, within the amx build,
  tiles or VDPBF16PS per shape.
- prefill chunks of `prefill_rows` rows or more (larger than any step without prompt rows): per
  shape, the fastest of the chosen build's kernels and oneDNN's packed linear, which re-blocks a
  row's sums by the row count. That changes one promise, which the default mode already makes for
  bf16 (a prefix-cache hit may round differently from a fresh prefill): a prompt's hidden rows may
  differ in their last bits with the chunk's size. Decode and verify rows never take such a kernel:
  a step mixing them with a large chunk is split (`prefill_split.py`), and `--batch-invariant` keeps
  every call on the exact kernels.

A kernel becomes the choice only if it beats the default (the highest build's own kernel, what the
flags alone chose before) by `MARGIN` (a prefill-only kernel by `PREFILL_MARGIN`): on a shared
machine a few percent is noise, and a switch must pay for itself. The choice is cached as JSON
beside the model, keyed by the CPU's model name, the builds' ids, the shapes, the row buckets and the
thread count, so a second start measures nothing.
`--cpu-kernels <build>` skips the measurement and runs that build's kernel for every call.

The parts: the options (`kernel_options.py`), the timing (`kernel_timing.py`), the plan and its
decision from the times (`linear_plan.py`), the cache (`kernel_cache.py`); this file puts them
together at load. Quantized weights with int8 activations (--quantized-activations int8) have a
choice of their own on the amx build, VPDPBUSD or AMX-INT8 tiles (`int8_tile_choice.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from tandem.client.errors import ConfigError
from tandem.decoder.backends.cpu.build import Level, levels_for
from tandem.decoder.backends.cpu.isa import CpuInfo, runnable_levels, this_cpu
from tandem.decoder.backends.cpu.kernel_cache import cache_key, read_plan, write_plan
from tandem.decoder.backends.cpu.kernel_options import AUTO, KernelOptions
from tandem.decoder.backends.cpu.kernel_timing import MIN_MEASURED_BYTES, Binder, linear_weights, measure
from tandem.decoder.backends.cpu.kernels import Kernels, KernelsUnavailable, load, load_for_cpu
from tandem.decoder.backends.cpu.linear import CLinear, PackedLinear, has_onednn_bf16
from tandem.decoder.backends.cpu.linear_plan import ONEDNN, TILES, Family, LinearPlan, decide

log = logging.getLogger(__name__)


def choose(
    model: torch.nn.Module, options: KernelOptions, cpu: CpuInfo | None = None
) -> tuple[Kernels | None, LinearPlan | None]:
    """The build to load and the plan for the model's bf16 linears (None: no bf16 linears to choose
    for, several ranks, or no build: the executor then chooses as the flags say). Raises ValueError
    naming --cpu-kernels when the build it names cannot run here."""
    cpu = cpu or this_cpu()
    if options.kernels != AUTO:
        return _override(model, options, cpu)
    loaded = _loadable(runnable_levels(cpu))
    if not loaded:
        return load_for_cpu(cpu), None  # None, said in one warning
    top = loaded[-1]
    counts, weights, head = linear_weights(model)
    if model.config.dtype != torch.bfloat16 or model.tp is not None or not counts or _has_quantized(model):
        return top, None
    if sum(n * s[0] * s[1] * 2 for s, n in counts.items()) < MIN_MEASURED_BYTES:
        return top, None
    families = _families(loaded)
    prefill_candidates = (ONEDNN,) if options.prefill_buckets and has_onednn_bf16() else ()
    buckets = {s: options.exact_buckets + (() if s == head else options.prefill_buckets) for s in counts}
    key = cache_key(cpu, loaded, counts, buckets, prefill_candidates)
    cached = read_plan(options.cache_dir, key, options)
    if cached is not None:
        plan = cached
        # The table was logged when it was measured and is in the cache file: a start that measures
        # nothing says its choice in one line (30 lines a start were noise), the table at debug.
        log.info("CPU kernels for %s: %s, cached in %s", cpu.model_name, plan.describe(), options.cache_dir)
        log.debug("CPU kernels, the cached timings:\n%s", plan.table())
    else:
        started = time.perf_counter()
        binders = _binders(loaded, families)
        timings = measure(
            binders, weights, buckets, prefill_candidates, options.exact_rows, families[0].kernels
        )
        plan = decide(timings, counts, families, options, prefill_candidates)
        log.info("CPU kernels for %s [%s], %d threads, measured in %.1f s: %s\n%s", cpu.model_name,
                 cpu.isa_summary, torch.get_num_threads(), time.perf_counter() - started, plan.describe(),
                 plan.table())  # fmt: skip
        write_plan(options.cache_dir, key, plan)
    return next(k for k in loaded if k.level.name == plan.level), plan


def _override(model: torch.nn.Module, options: KernelOptions, cpu: CpuInfo) -> tuple[Kernels, LinearPlan]:
    kernels = check_kernels(options.kernels, cpu)
    counts, _, _ = linear_weights(model)
    kernel_of = tuple((s, options.kernels) for s in sorted(counts))
    return kernels, LinearPlan(options.kernels, kernel_of, kernel_of, options.prefill_rows, "--cpu-kernels")


def check_kernels(name: str, cpu: CpuInfo | None = None) -> Kernels:
    """The build --cpu-kernels names, loaded; ConfigError (cpu_kernels) saying why it cannot run here."""
    cpu = cpu or this_cpu()
    runnable = runnable_levels(cpu)
    level = next((level for level in levels_for(cpu.machine) if level.name == name), None)
    if level is None or level not in runnable:
        needs = f" (it needs {' '.join(sorted(level.cpu_flags - cpu.flags))})" if level is not None else ""
        choices = ", ".join(level.name for level in runnable)
        raise ConfigError(
            "cpu_kernels", f": {name} cannot run on this CPU{needs}; it runs {choices} (or auto)"
        )
    try:
        kernels = load(level)
    except KernelsUnavailable as error:
        raise ConfigError("cpu_kernels", f": the {name} build cannot be loaded: {error}") from None
    if name == TILES and not kernels.tiles:
        raise ConfigError("cpu_kernels", ": amx: the kernel refused this process the tile state (arch_prctl)")
    return kernels


def _loadable(levels: Sequence[Level]) -> list[Kernels]:
    loaded = []
    for level in levels:
        try:
            loaded.append(load(level))
        except KernelsUnavailable as error:
            log.info("CPU kernels: the %s build is not a candidate: %s", level.name, error)
    return loaded


def _has_quantized(model: torch.nn.Module) -> bool:
    """Quantized projections run their own kernel, in the highest build: no build switch then."""
    return any(hasattr(module, "qweight") for module in model.modules())


def _families(loaded: Sequence[Kernels]) -> list[Family]:
    """The builds' kernel families, the highest build first; the amx build runs VDPBF16PS (its
    default) and, with the tile state granted, tiles, so the avx512bf16 build is no family of its own."""
    names = [k.level.name for k in loaded]
    families = []
    for kernels in reversed(loaded):
        name = kernels.level.name
        if name == TILES:
            families.append(Family(name, ("avx512bf16", TILES) if kernels.tiles else ("avx512bf16",)))
        elif not (name == "avx512bf16" and TILES in names):
            families.append(Family(name, (name,)))
    return families


def _binders(loaded: Sequence[Kernels], families: Sequence[Family]) -> dict[str, Binder]:
    by_name = {k.level.name: k for k in loaded}
    binders: dict[str, Binder] = {}
    for family in families:
        kernels = by_name[family.level]
        for kernel in family.kernels:
            tile_rows = 1 if kernel == TILES else 0
            binders[kernel] = lambda w, kernels=kernels, t=tile_rows: CLinear(kernels, w, None, t)
    binders[ONEDNN] = lambda w: PackedLinear(w, None)
    return binders
