"""A token table sample, compared and carried in a reply: what the decoder compares with its encoder's,
and the gateway across its decoder replicas (without torch)."""

from __future__ import annotations

from tandem.common.token_table_sample import TableSample, sample_from_pb, sample_to_pb

VALUES = tuple((i - 64) / 1000 + 1e-9 for i in range(128))  # not float32 numbers: rounded on the wire
SAMPLE = TableSample(1024, 64, VALUES)


def test_a_sample_carried_in_a_reply_is_read_back_as_the_same_model() -> None:
    read = sample_from_pb(sample_to_pb(SAMPLE))
    assert (read.vocab_size, read.hidden_size) == (1024, 64)
    assert read.values != VALUES  # float32 on the wire
    assert read.is_same_model(SAMPLE) and SAMPLE.is_same_model(read)


def test_values_apart_by_more_than_rounding_are_another_model() -> None:
    assert not TableSample(1024, 64, tuple(v * (1 + 2.0**-5) for v in VALUES)).is_same_model(SAMPLE)
    assert TableSample(1024, 64, tuple(v * (1 + 2.0**-9) for v in VALUES)).is_same_model(SAMPLE)


def test_another_shape_is_another_model_whatever_its_values() -> None:
    assert not TableSample(2048, 64, VALUES).is_same_model(SAMPLE)
    assert not TableSample(1024, 64, VALUES[:64]).is_same_model(SAMPLE)


def test_a_nan_agrees_with_a_nan_so_a_checkpoint_is_the_same_model_as_itself() -> None:
    # isclose(nan, nan) is False: every replica of a checkpoint with a NaN at a sampled place was left
    # out as another checkpoint, its own included, and the gateway's /health said 503.
    with_nan = TableSample(1024, 64, (float("nan"), *VALUES[1:]))
    assert with_nan.is_same_model(with_nan)
    assert not with_nan.is_same_model(SAMPLE)
