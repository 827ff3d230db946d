"""Samples of a checkpoint's weights beyond its token table, and when two checkpoints' agree: what the
gateway compares across the decoder replicas it serves under one name, beside the token table sample
(`tandem.common.token_table_sample`).

NOTE: why beyond the table. A fine-tune that froze its embeddings, or a LoRA merged into its base, keeps
the base's token table bit for bit and answers otherwise: three replicas of a base and such a tune under
one `--model-name` all passed the table check and answered differently. The tensors sampled are the
last decoder layer's down_proj, the final norm and lm_head where the checkpoint holds its own (an
untied head): every tune that trains the layers moves the last one's, and the norm and head are what
every token's logits pass through. What is still not told apart: a tune that moves every sampled value
by less than 2^-7 relative (the tolerance storage dtypes need), and one that changes only layers not
sampled (an adapter on the first layers alone, merged). Adapters loaded at run time are not the
checkpoint's: they are named apart (LoadAdapter), and never sampled.

Its own module, torch-free, as the table sample's: the gateway compares samples and loads no tensor
library; the reading is `tandem.common.torch_part.model_identity`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.common.token_table_sample import values_agree

FULL = 2  # samples in a full one (the norm and one more): two full ones that share no tensor disagree


@dataclass(frozen=True)
class WeightSample:
    """Values of one checkpoint tensor at the positions `model_identity.sample_positions` gives for its
    shape; a one-dimensional tensor is one row."""

    name: str  # a causal LM's checkpoint's name for it, whatever the layout (a LLaVA's is another)
    rows: int  # 1 for a one-dimensional tensor
    columns: int
    values: tuple[float, ...]  # row by row, as float32

    def agrees_with(self, other: WeightSample) -> bool:
        if (self.rows, self.columns) != (other.rows, other.columns):
            return False
        return values_agree(self.values, other.values)


def weights_agree(ours: Sequence[WeightSample], theirs: Sequence[WeightSample]) -> bool:
    """The tensors both sampled agree. A decoder from before the samples reports none, and a checkpoint
    that stores a tied lm_head has one sample more than one that does not: what only one side has is
    not compared. But two full samples (FULL or more each) with no tensor in common disagree: nothing
    compared is no agreement, and every checkpoint sampled that fully holds the final norm."""
    by_name = {sample.name: sample for sample in theirs}
    if min(len(ours), len(theirs)) >= FULL and not any(sample.name in by_name for sample in ours):
        return False
    return all(sample.agrees_with(by_name[sample.name]) for sample in ours if sample.name in by_name)


def weight_sample_to_pb(sample: WeightSample) -> decoder_pb2.WeightSample:
    return decoder_pb2.WeightSample(
        name=sample.name, rows=sample.rows, columns=sample.columns, values=sample.values
    )


def weight_sample_from_pb(sample: decoder_pb2.WeightSample) -> WeightSample:
    return WeightSample(sample.name, sample.rows, sample.columns, tuple(sample.values))
