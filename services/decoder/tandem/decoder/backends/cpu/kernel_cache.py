"""The measured choices cached beside the model (`cpu-kernels.json`), so that a second start measures
nothing: one file of entries, each under the key of what it was measured with (`cache_key` for the
bf16 plan, `int8_tile_choice`'s own for the int8 tiles). An entry this code cannot read is measured
again and rewritten; the file is replaced whole, never written in place."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tandem.decoder.backends.cpu.build import build_id
from tandem.decoder.backends.cpu.isa import CpuInfo
from tandem.decoder.backends.cpu.kernel_options import KernelOptions
from tandem.decoder.backends.cpu.kernels import Kernels
from tandem.decoder.backends.cpu.linear_plan import LinearPlan, Shape, Timing

log = logging.getLogger(__name__)

CACHE_FILE = "cpu-kernels.json"
CACHE_VERSION = 1


def key_of(facts: Mapping[str, Any]) -> str:
    """An entry's key: the hash of what it was measured with, whatever the facts' order."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def cache_key(
    cpu: CpuInfo,
    loaded: Sequence[Kernels],
    counts: Mapping[Shape, int],
    buckets: Mapping[Shape, Sequence[int]],
    prefill_candidates: Sequence[str],
) -> str:
    """What a cached choice must have been measured with: this CPU, these builds (their ids; the
    tiles granted or not), these shapes at these row counts, these threads, this torch (its oneDNN)."""
    facts = {
        "cpu": cpu.model_name,
        "isa": cpu.isa_summary,
        "builds": {k.level.name: [build_id(k.level), k.tiles] for k in loaded},
        "shapes": sorted([*s, counts[s], *buckets[s]] for s in counts),
        "prefill_candidates": list(prefill_candidates),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "version": CACHE_VERSION,
    }
    return key_of(facts)


def read_entry(directory: Path | None, key: str) -> dict | None:
    """The cache's entry under `key`, or None (no cache, none yet, or unreadable)."""
    if directory is None:
        return None
    try:
        entry = json.loads((directory / CACHE_FILE).read_text())["entries"][key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return entry if isinstance(entry, dict) else None


def read_plan(directory: Path | None, key: str, options: KernelOptions) -> LinearPlan | None:
    """The bf16 plan cached under `key`, or None."""
    entry = read_entry(directory, key)
    if entry is None:
        return None
    try:
        return LinearPlan(
            level=entry["level"],
            exact=tuple(((n, k), kernel) for n, k, kernel in entry["exact"]),
            prefill=tuple(((n, k), kernel) for n, k, kernel in entry["prefill"]),
            prefill_rows=options.prefill_rows,
            source="cached",
            timings=tuple(Timing(kernel, (n, k), rows, s) for kernel, n, k, rows, s in entry["timings"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: measured again and rewritten


def write_plan(directory: Path | None, key: str, plan: LinearPlan) -> None:
    """`plan` cached under `key`, with the timings it was decided from (the table a cached start
    logs at debug)."""
    write_entry(
        directory,
        key,
        {
            "level": plan.level,
            "exact": [[*s, k] for s, k in plan.exact],
            "prefill": [[*s, k] for s, k in plan.prefill],
            "timings": timings_json(plan.timings),
        },
    )


def timings_json(timings: Iterable[Timing]) -> list[list]:
    """Timings as an entry holds them: [kernel, n, k, rows, seconds] each."""
    return [[t.kernel, *t.shape, t.rows, t.seconds] for t in timings]


def write_entry(directory: Path | None, key: str, entry: dict) -> None:
    """The cache file with `entry` under `key`, beside the others (a file that is not ours is
    replaced)."""
    if directory is None:
        return
    path = directory / CACHE_FILE
    try:
        entries = json.loads(path.read_text()).get("entries", {}) if path.exists() else {}
    except (OSError, ValueError, AttributeError):
        entries = {}
    if not isinstance(entries, dict):
        entries = {}
    entries[key] = entry
    temporary = path.with_name(f".{CACHE_FILE}.{os.getpid()}")
    try:
        temporary.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1))
        os.replace(temporary, path)  # whole or not at all, whatever else starts beside us
    except OSError as error:
        log.info("CPU kernels: the measured choice is not cached (%s): the next start measures again", error)
