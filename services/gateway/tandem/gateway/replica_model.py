"""Which model a decoder replica serves, and which one the gateway serves over several: what `Replicas`
compares as each replica turns SERVING.

NOTE: why a name is not enough. Two replicas started with `--model-name` over two checkpoints of one
shape (a fine-tune beside its base, a directory copied over another) report the same name, hidden size
and vocabulary, and the callers' requests were answered by either checkpoint under one name. A decoder
reports a sample of its token table (`tandem.common.token_table_sample`): two replicas serve the same
model when their names are the same and their samples agree (within the storage dtypes' rounding). A
decoder from before the sample reports none and is compared by its name alone, as before.

The gateway serves the model most replicas serve: a replica of an older decoder counts towards every
model of its name, and a model of that name without a sample is chosen only where no replica of that
name reports one (else any checkpoint of the name would pass against it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.common.token_table_sample import TableSample, sample_from_pb


@dataclass(frozen=True)
class ReplicaModel:
    """A replica's model, as its GetModelInfo said."""

    name: str  # the name it serves its model under (`model`)
    sample: TableSample | None  # its token table's; None: a decoder from before the sample

    @classmethod
    def from_info(cls, info: decoder_pb2.DecoderGetModelInfoResponse) -> ReplicaModel:
        sample = sample_from_pb(info.token_table_sample) if info.HasField("token_table_sample") else None
        return cls(info.model, sample)

    def is_same(self, other: ReplicaModel) -> bool:
        """The same name, and the same checkpoint where both report a sample."""
        if self.name != other.name:
            return False
        return self.sample is None or other.sample is None or self.sample.is_same_model(other.sample)


def choose_model(models: Sequence[ReplicaModel], current: ReplicaModel | None) -> ReplicaModel | None:
    """The model most of `models` (the serving replicas', in the order found) are the same as; on a tie
    `current`, the model served so far, stays. `current` without a sample gives way to a model of its
    name with one, which is no change of model: only the first replica with a sample came."""
    sampled_names = {model.name for model in models if model.sample is not None}
    candidates = [m for m in models if m.sample is not None or m.name not in sampled_names]
    if not candidates:
        return current
    counts = [sum(candidate.is_same(model) for model in models) for candidate in candidates]
    most = max(counts)
    winners = [candidate for candidate, count in zip(candidates, counts, strict=True) if count == most]
    if current is not None:
        for winner in winners:
            if winner.is_same(current):
                return current if current.sample is not None else winner
    return winners[0]
