"""One sampled position of a step (`Row`), and what the sampler takes of it: a seeded row's noise,
drawn from a generator reseeded for the output position the row samples (`position_seed`), and the
tokens its penalties count.

NOTE: both depend on the row's output position alone, never on the step that samples it, which is
what lets a seeded request give the same tokens with speculation as without (core.py's NOTE).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from tandem.decoder.engine.step.tracked import Tracked


@dataclass(frozen=True)
class Row:
    """One sampled position of a step: request `tracked`'s output position n + `ahead`."""

    tracked: Tracked
    ahead: int  # 0 = the token after the last sampled one; j = after j proposed tokens


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's output position: a hash of both, so the noise of
    every position is its own whatever a step samples, and nearby seeds or positions share nothing.
    (CPU generators keep the low 32 bits, CUDA's all 64.)"""
    key = (seed % 2**64).to_bytes(8, "little") + position.to_bytes(8, "little")
    digest = hashlib.blake2b(key, digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def reseed(rows: list[Row], device: torch.device) -> None:
    """Seed each seeded row's generator for its output position, adding generators on `device` for
    rows further ahead than its request sampled before."""
    for row in rows:  # a seeded row's noise is its output position's, whatever the step
        request = row.tracked.request
        if request.sampling.seed is not None:
            generators = row.tracked.generators
            while len(generators) <= row.ahead:
                generators.append(torch.Generator(device=device))
            position = request.num_output_tokens + row.ahead
            generators[row.ahead].manual_seed(position_seed(request.sampling.seed, position))


def generator(row: Row) -> torch.Generator | None:
    generators = row.tracked.generators
    return generators[row.ahead] if generators else None


def history(row: Row) -> list[int]:
    """The output tokens row `row`'s penalties count: the request's, then the proposal's first j."""
    request = row.tracked.request
    return request.output_token_ids + request.draft_token_ids[: row.ahead]
