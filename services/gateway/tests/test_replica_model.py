"""A decoder replica's model is its name and, from decoders that report them, its token table sample and
its later weights' samples; the gateway serves the model most serving replicas serve, the one served so
far on a tie."""

from __future__ import annotations

from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2
from tandem.common.token_table_sample import TableSample
from tandem.common.weight_sample import WeightSample, weight_sample_to_pb
from tandem.gateway.replica_model import ReplicaModel, choose_model

BASE = TableSample(1024, 64, tuple((i - 64) / 100 for i in range(128)))
TUNED = TableSample(1024, 64, tuple(-v for v in BASE.values))  # one shape, other weights
BASE_BF16 = TableSample(1024, 64, tuple(v * (1 + 2.0**-9) for v in BASE.values))  # rounded elsewhere

A = ReplicaModel("m", BASE)
B = ReplicaModel("m", TUNED)
OLD = ReplicaModel("m", None)  # a decoder from before the sample

DOWN = WeightSample("model.layers.1.mlp.down_proj.weight", 64, 256, BASE.values)
DOWN_TUNED = WeightSample(DOWN.name, 64, 256, tuple(v * 1.05 for v in DOWN.values))
A_WEIGHTS = ReplicaModel("m", BASE, (DOWN,))
TUNE = ReplicaModel("m", BASE, (DOWN_TUNED,))  # a fine-tune that froze the table, or a merged LoRA


def test_one_name_over_two_checkpoints_is_two_models() -> None:
    assert not A.is_same(B) and not B.is_same(A)
    assert A.is_same(ReplicaModel("m", BASE_BF16))
    assert not A.is_same(ReplicaModel("n", BASE))


def test_a_decoder_without_a_sample_is_compared_by_its_name_alone() -> None:
    assert OLD.is_same(A) and OLD.is_same(B) and A.is_same(OLD)
    assert not OLD.is_same(ReplicaModel("n", None))


def test_an_encoder_is_the_model_its_rows_are_for_and_its_embedder() -> None:
    """A token table lookup and a projector of one checkpoint report its name and sample alike, and
    embed one input differently: two models, told apart by the embedder."""
    sample = encoder_pb2.TokenTableSample(vocab_size=1024, hidden_size=64, values=BASE.values)

    def encoder(embedder: str, model: str = "m") -> ReplicaModel:
        info = encoder_pb2.EncoderGetModelInfoResponse(
            model=model, embedder=embedder, token_table_sample=sample
        )
        return ReplicaModel.from_encoder_info(info)

    assert encoder("lookup").is_same(encoder("lookup"))
    assert encoder("projector").difference(encoder("lookup")) == "embedder"
    assert encoder("lookup", "n").difference(encoder("projector")) == "model"
    assert choose_model([encoder("lookup"), encoder("projector"), encoder("lookup")], None) == encoder(
        "lookup"
    )


def test_a_model_is_read_from_a_replicas_model_info_with_or_without_its_sample() -> None:
    sample = encoder_pb2.TokenTableSample(vocab_size=1024, hidden_size=64, values=BASE.values)
    info = decoder_pb2.DecoderGetModelInfoResponse(model="m", token_table_sample=sample)
    assert ReplicaModel.from_info(info).is_same(A) and not ReplicaModel.from_info(info).is_same(B)
    assert ReplicaModel.from_info(decoder_pb2.DecoderGetModelInfoResponse(model="m")) == OLD


def test_most_replicas_choose_the_checkpoint_and_a_tie_keeps_the_one_served() -> None:
    assert choose_model([B, A, A], None) == A
    assert choose_model([A, B], B) == B
    assert choose_model([A, B], None) == A  # none served yet: the first found


def test_older_decoders_count_for_every_checkpoint_of_their_name_and_choose_none() -> None:
    assert choose_model([OLD, A, B], A) == A  # 2 each: A stays, and B is still another model
    assert choose_model([OLD, OLD], None) == OLD
    # Chosen while only older decoders answered, it gives way to the first sample of its name.
    assert choose_model([OLD, B], OLD) == B


def test_without_a_known_model_the_one_served_stays() -> None:
    assert choose_model([], A) == A


def test_a_tune_that_kept_the_token_table_is_another_model_by_its_weight_samples() -> None:
    assert not A_WEIGHTS.is_same(TUNE) and not TUNE.is_same(A_WEIGHTS)
    bf16 = tuple(v * (1 + 2.0**-9) for v in DOWN.values)
    assert A_WEIGHTS.is_same(ReplicaModel("m", BASE_BF16, (WeightSample(DOWN.name, 64, 256, bf16),)))
    assert choose_model([A_WEIGHTS, TUNE, A_WEIGHTS], None) == A_WEIGHTS


def test_a_decoder_without_weight_samples_is_compared_by_what_both_report() -> None:
    assert A.is_same(TUNE) and A.is_same(A_WEIGHTS)  # the table sample alone
    assert not B.is_same(TUNE)
    # Chosen while only decoders without weight samples answered, it gives way to the first with them.
    assert choose_model([A, TUNE], A) == TUNE
    assert choose_model([A, A_WEIGHTS, TUNE], A) == A_WEIGHTS  # 2 to 2: the one served stays


def test_weight_samples_are_read_from_a_replicas_model_info() -> None:
    sample = encoder_pb2.TokenTableSample(vocab_size=1024, hidden_size=64, values=BASE.values)
    info = decoder_pb2.DecoderGetModelInfoResponse(
        model="m", token_table_sample=sample, weight_samples=[weight_sample_to_pb(DOWN_TUNED)]
    )
    assert ReplicaModel.from_info(info).is_same(TUNE) and not ReplicaModel.from_info(info).is_same(A_WEIGHTS)


def test_what_tells_two_models_apart_is_said() -> None:
    assert A.difference(ReplicaModel("n", BASE)) == "model"
    assert A.difference(B) == "token_table_sample" and A_WEIGHTS.difference(TUNE) == "weight_samples"
    assert A.difference(ReplicaModel("m", BASE_BF16)) is None


NORM = WeightSample("model.norm.weight", 1, 64, BASE.values[:8])
HEAD = WeightSample("lm_head.weight", 1024, 64, BASE.values)
TIED = ReplicaModel("m", BASE, (DOWN, NORM))  # its lm_head is its token table: not sampled
UNTIED = ReplicaModel("m", BASE, (DOWN_TUNED, NORM, HEAD))  # another checkpoint, storing its head


def test_a_model_reporting_more_samples_does_not_outvote_a_larger_group_it_is_told_apart_from() -> None:
    assert choose_model([TIED, TIED, UNTIED], None) == TIED
    assert choose_model([UNTIED, TIED, TIED], UNTIED) == TIED
    other = ReplicaModel("m", TUNED, (DOWN_TUNED, NORM, HEAD))  # unrelated, its table too
    assert choose_model([TIED] * 5 + [other], None) == TIED
    # One reporting less and the same as it still gives way to it.
    assert choose_model([A, UNTIED], A) == UNTIED
