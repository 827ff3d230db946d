"""The C kernels' limits come from C: each build exports what csrc/limits.h defines, and fits() refuses
a size past any of them with the limit's name, or takes it at the limit itself."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from tandem.decoder.backends.cpu.build import CSRC
from tandem.decoder.backends.cpu.kernels import Kernels
from tandem.decoder.backends.cpu.limits import Limits, fits


def header_limits() -> dict[str, int]:
    """csrc/limits.h's `#define TANDEM_<NAME> <number>` lines, read as text (not through any build)."""
    text = (CSRC / "limits.h").read_text()
    return {
        name.lower(): int(value) for name, value in re.findall(r"^#define TANDEM_(\w+) +(\d+)", text, re.M)
    }


def test_a_build_exports_exactly_the_limits_its_header_defines(kernels: Kernels) -> None:
    assert dataclasses.asdict(kernels.limits) == header_limits()


def test_every_limit_is_a_positive_size(kernels: Kernels) -> None:
    assert all(value >= 1 for value in dataclasses.asdict(kernels.limits).values())


def past(limits: Limits, name: str) -> dict[str, Any]:
    """fits() arguments one step past the limit `name` and within every other."""
    value = getattr(limits, name)
    return {
        "max_head_dim": {"head_dim": value + 1},
        "max_group": {"num_heads": 2 * (value + 1), "num_kv_heads": 2},
        "max_block_size": {"block_size": value + 1},
        "max_row": {"row": value + 1},
        "tiled_head_dim": {"head_dim": value // 2, "tiled": True},
        "prefill_max_context": {"prefill_context": value + 1},
    }[name]


def at(limits: Limits, name: str) -> dict[str, Any]:
    """fits() arguments exactly at the limit `name`."""
    value = getattr(limits, name)
    return {
        "max_head_dim": {"head_dim": value},
        "max_group": {"num_heads": 2 * value, "num_kv_heads": 2},
        "max_block_size": {"block_size": value},
        "max_row": {"row": value},
        "tiled_head_dim": {"head_dim": value, "tiled": True},
        "prefill_max_context": {"prefill_context": value},
    }[name]


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Limits)])
def test_fits_refuses_a_size_past_each_limit_by_the_limits_name(kernels: Kernels, name: str) -> None:
    refused = fits(kernels.limits, **past(kernels.limits, name))
    assert not refused
    assert name in refused.reason and str(getattr(kernels.limits, name)) in refused.reason
    assert fits(kernels.limits, **at(kernels.limits, name))


def test_fits_refuses_heads_rope_cannot_rotate_or_kv_heads_cannot_share() -> None:
    limits = Limits(max_head_dim=256, max_group=16, max_block_size=64, max_row=16384, tiled_head_dim=64,
                    prefill_max_context=640)  # fmt: skip
    assert fits(limits, head_dim=63) and "even" in fits(limits, head_dim=63, rotary=True).reason
    assert "multiple of num_kv_heads 4" in fits(limits, num_heads=6, num_kv_heads=4).reason
    assert not fits(limits, num_heads=0, num_kv_heads=1) and not fits(limits, head_dim=0)
    # The tiled kernel attends a prefill at any context: the row kernel's crossover is not its limit.
    assert fits(limits, prefill_context=10**6, tiled=True)


def test_fits_asks_nothing_it_is_not_given() -> None:
    tiny = Limits(
        max_head_dim=1, max_group=1, max_block_size=1, max_row=1, tiled_head_dim=1, prefill_max_context=1
    )
    assert fits(tiny) and fits(tiny, head_dim=1, num_heads=1, num_kv_heads=1, block_size=1, row=1)
