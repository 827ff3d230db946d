"""A sample of a checkpoint's token table, and when two are of one model: what a decoder compares with
its encoder's, and the gateway across the decoder replicas it serves under one name.

Its own module, apart from the reading (`tandem.common.torch_part.model_identity`, which needs
safetensors and torch): the gateway compares samples and loads no tensor library.

The samples are compared within a tolerance, not bit for bit, since one model reaches two services in
different storage dtypes: a GGUF file imported in bfloat16 for one and in float32 for the other holds
the same values rounded differently (at most 2^-9 apart, relatively, in bfloat16; less in float16).
Two checkpoints trained (or drawn) apart differ far beyond that in almost every value: the 128 would
all have to agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.client.pb.tandem.v1 import encoder_pb2

REL_TOLERANCE = 2.0**-7  # bfloat16's rounding (2^-9 relative) with room for a second rounding
ABS_TOLERANCE = 1e-6  # float16's subnormals, below 6e-5, lose relative precision


@dataclass(frozen=True)
class TableSample:
    """Values of a checkpoint's token table at the positions `model_identity.sample_positions` gives
    for its shape."""

    vocab_size: int
    hidden_size: int
    values: tuple[float, ...]  # [NUM_ROWS * NUM_COLUMNS], row by row, as float32

    def is_same_model(self, other: TableSample) -> bool:
        if (self.vocab_size, self.hidden_size) != (other.vocab_size, other.hidden_size):
            return False
        return values_agree(self.values, other.values)


def values_agree(ours: Sequence[float], theirs: Sequence[float]) -> bool:
    """Each value within the storage dtypes' rounding of the other's (a sample of any tensor). A NaN
    agrees with a NaN: isclose says no, and one checkpoint's samples then differed from themselves, every
    replica of it left out (/health 503)."""
    if len(ours) != len(theirs):
        return False
    return all(
        math.isclose(a, b, rel_tol=REL_TOLERANCE, abs_tol=ABS_TOLERANCE) or (math.isnan(a) and math.isnan(b))
        for a, b in zip(ours, theirs, strict=True)
    )


def sample_to_pb(sample: TableSample) -> encoder_pb2.TokenTableSample:
    return encoder_pb2.TokenTableSample(
        vocab_size=sample.vocab_size, hidden_size=sample.hidden_size, values=sample.values
    )


def sample_from_pb(sample: encoder_pb2.TokenTableSample) -> TableSample:
    return TableSample(sample.vocab_size, sample.hidden_size, tuple(sample.values))
