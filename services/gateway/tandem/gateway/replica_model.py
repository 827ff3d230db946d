"""Which model a decoder replica serves, and which one the gateway serves over several: what `Replicas`
compares as each replica turns SERVING. An encoder replica's too (`encoders.py`): the decoder checkpoint
whose hidden space its rows live in, its token table sample, and its embedder (a token table lookup and
a projector of one checkpoint embed one input differently).

NOTE: why a name is not enough. Two replicas started with `--model-name` over two checkpoints of one
shape (a fine-tune beside its base, a directory copied over another) report the same name, hidden size
and vocabulary, and the callers' requests were answered by either checkpoint under one name. A decoder
reports a sample of its token table (`tandem.common.token_table_sample`) and of a few later weights
(`tandem.common.weight_sample`: the last layer's down_proj, the final norm, an untied lm_head; a
fine-tune that froze the table, or a merged LoRA, keeps its base's table): two replicas serve the same
model when their names are the same and their samples agree, each value within 2^-7 relative (the
storage dtypes' rounding). So a tune that moves every sampled value by less than that passes for its
base, and so does one that changes only layers not sampled: those are not told apart. A decoder from
before a sample reports none of it and is compared by what both report (by its name alone, the
oldest), as before.

The gateway serves the model most replicas serve: a replica of an older decoder counts towards every
model it cannot be told from, and a model reporting less than another the same as it is not chosen (it
would count replicas of checkpoints the other is told apart from). A model reporting less than another
it is told apart from still counts: a checkpoint storing its lm_head reports one weight sample more
than a tied one, and is no reason to leave out a larger group of the tied one.

NOTE: ties. On a tie the model served so far stays. The models counted are those each replica said
last, serving or not (`replicas.py`), so restarting the replica of the gateway's model in a 1-vs-1 pair
keeps its model: the other's, left out, never wins by the restart's absence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2
from tandem.common.token_table_sample import TableSample, sample_from_pb
from tandem.common.weight_sample import WeightSample, weight_sample_from_pb, weights_agree


@dataclass(frozen=True)
class ReplicaModel:
    """A replica's model, as its GetModelInfo said."""

    name: str  # the name it serves its model under (`model`)
    sample: TableSample | None  # its token table's; None: a decoder from before the sample
    weights: tuple[WeightSample, ...] = ()  # its later weights'; empty: a decoder from before them
    embedder: str = ""  # an encoder's kind ("lookup", "soft-prompt", "projector"); "": a decoder

    @classmethod
    def from_info(cls, info: decoder_pb2.DecoderGetModelInfoResponse) -> ReplicaModel:
        sample = sample_from_pb(info.token_table_sample) if info.HasField("token_table_sample") else None
        return cls(info.model, sample, tuple(weight_sample_from_pb(w) for w in info.weight_samples))

    @classmethod
    def from_encoder_info(cls, info: encoder_pb2.EncoderGetModelInfoResponse) -> ReplicaModel:
        """An encoder's: its embeddings' model (the decoder checkpoint named), sampled as a decoder's
        table is, and its embedder. It reports no weight samples."""
        sample = sample_from_pb(info.token_table_sample) if info.HasField("token_table_sample") else None
        return cls(info.model, sample, embedder=info.embedder)

    @property
    def detail(self) -> tuple[bool, int]:
        """How much of its checkpoint it reports: a model reporting more is told apart from more."""
        return self.sample is not None, len(self.weights)

    def is_same(self, other: ReplicaModel) -> bool:
        """The same name, and the same checkpoint as far as the samples both report go."""
        return self.difference(other) is None

    def difference(self, other: ReplicaModel) -> str | None:
        """What tells it from `other`, the first found: "model" (its name), "embedder",
        "token_table_sample" or "weight_samples" (what /health says differs); None: the same model."""
        if self.name != other.name:
            return "model"
        if self.embedder != other.embedder:
            return "embedder"
        if (
            self.sample is not None
            and other.sample is not None
            and not self.sample.is_same_model(other.sample)
        ):
            return "token_table_sample"
        return None if weights_agree(self.weights, other.weights) else "weight_samples"


def choose_model(models: Sequence[ReplicaModel], current: ReplicaModel | None) -> ReplicaModel | None:
    """The model most of `models` (the replicas' last said, in the order found) are the same as; on a tie
    `current`, the model served so far, stays. `current` reporting less than a winner the same as it
    gives way to it, which is no change of model: only the first replica reporting more came."""
    # A model reporting more than one it is the same as stands for it. Not "the most detail of the name
    # wins": one replica of an untied-head checkpoint (3 weight samples) took all traffic from two of
    # another, tied one (2) under one name.
    candidates = [m for m in models if not any(o.detail > m.detail and o.is_same(m) for o in models)]
    if not candidates:
        return current
    counts = [sum(candidate.is_same(model) for model in models) for candidate in candidates]
    most = max(counts)
    winners = [candidate for candidate, count in zip(candidates, counts, strict=True) if count == most]
    if current is not None:
        for winner in winners:
            if winner.is_same(current):
                return current if current.detail >= winner.detail else winner
    return winners[0]
