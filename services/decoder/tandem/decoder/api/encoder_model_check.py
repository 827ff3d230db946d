"""Whether an encoder serves this decoder's model: the token table sample it reports against this
decoder's own (`tandem.common.torch_part.model_identity`; compared as `tandem.common.token_table_sample`
says), and the words of a refusal naming both.

Its own module, apart from the fetching in `encoder_parts.py`, which asks (GetModelInfo: at start, or at
a first encoder part) and reads every Embed reply's sample: this is the comparison all three share, with
no call, no channel and no shared memory in it. An encoder of another model of the same hidden size
would have its rows read in the wrong model's hidden space and served OK; the name and the shape cannot
tell two such models apart, a sample of the token table can.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.common.replica_name import answering
from tandem.common.token_table_sample import TableSample, sample_from_pb

MAX_SAME_SAMPLES = 8  # token table samples remembered as this decoder's model (one per dtype, or so)


@dataclass(frozen=True)
class Mismatch:
    """Why an encoder is not of this decoder's model, in two sets of words: the operator's (`said`: the
    replica that answered and this decoder's checkpoint, to find the wrong one among several) and a
    caller's (`told`: the two models alone). A caller may be anyone the decoder serves, and the gateway
    passes the decoder's words on to HTTP callers: the address and the path are this host's layout."""

    said: str
    told: str


class EncoderModelCheck:
    """This decoder's model, as an encoder at `address` reports its own. Without a sample of its own (a
    decoder built by hand, with no model directory: tests and benchmarks) nothing is compared."""

    def __init__(
        self,
        address: str,  # the encoder's, as --encoder names it: the refusal names it, or its replica
        table_sample: TableSample | None,  # this decoder's token table's; None: nothing is compared
        model_dir: Path | None,  # this decoder's checkpoint, named in the refusal
        model_name: str,  # the name this decoder serves it under; "": the directory's name
    ) -> None:
        self.address = address
        self.table_sample = table_sample
        self.model_dir = model_dir
        self.model_name = model_name
        # Samples that replies carried and that were found this decoder's model, as their bytes: compared
        # once each, then matched exactly (0.4 us for its 520 bytes, where reading the 128 floats out of
        # the reply took 4 us and comparing them 20 us).
        self._same_samples: set[bytes] = set()

    def info_mismatch(
        self, info: encoder_pb2.EncoderGetModelInfoResponse, replica: str | None = None
    ) -> Mismatch | None:
        """Why the encoder that answered GetModelInfo with `info` (the replica that said it is `replica`:
        `tandem.common.replica_name`) is not of this decoder's model; None when it is, or when there is
        nothing to compare."""
        return self.mismatch(
            info.model, info.token_table_sample if info.HasField("token_table_sample") else None, replica
        )

    def reply_mismatch(self, reply: encoder_pb2.EmbedResponse, replica: str | None = None) -> Mismatch | None:
        """Why `reply` (of the replica that said it is `replica`) is of another model than this decoder's;
        None when it is, or when it carries no sample (an encoder from before replies carried one: its
        model was checked once, by GetModelInfo, and never again)."""
        if self.table_sample is None or not reply.HasField("token_table_sample"):
            return None
        reported = reply.token_table_sample
        key = reported.SerializeToString()
        if key in self._same_samples:
            return None
        mismatch = self.mismatch(reply.model, reported, replica)
        if mismatch is None and len(self._same_samples) < MAX_SAME_SAMPLES:
            self._same_samples.add(key)
        return mismatch

    def mismatch(
        self, model: str, reported: encoder_pb2.TokenTableSample | None, replica: str | None = None
    ) -> Mismatch | None:
        """Why an encoder serving `model`, whose token table sample is `reported`, is not of this
        decoder's model; None when it is, or when there is nothing to compare (a decoder built by hand,
        an encoder from before the sample). Names the replica that said it is `replica`, of several
        balanced: the address list named all of them, the wrong one among the right."""
        if self.table_sample is None or reported is None:
            return None
        theirs = sample_from_pb(reported)
        if theirs.is_same_model(self.table_sample):
            return None
        ours = self.table_sample
        name = self.model_name or (self.model_dir.name if self.model_dir is not None else "")
        shapes = (
            f"token table [{theirs.vocab_size}, {theirs.hidden_size}] against [{ours.vocab_size}, "
            f"{ours.hidden_size}]"
            if (theirs.vocab_size, theirs.hidden_size) != (ours.vocab_size, ours.hidden_size)
            else f"same token table shape [{ours.vocab_size}, {ours.hidden_size}], different values"
        )
        why = f"{shapes}, so its rows would be read in the wrong model's hidden space"
        return Mismatch(
            said=f"encoder {answering(self.address, replica)} serves model {model!r}, not this decoder's "
            f"{name!r} ({self.model_dir}): {why}; start the encoder with this decoder's --model",
            told=f"the encoder serves model {model!r}, not this decoder's {name!r}: {why}",
        )
