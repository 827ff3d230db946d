"""Sampling parameters' refusals echo each value as the caller wrote it, though the wire carries it as a
float32 (`shown_float`)."""

from __future__ import annotations

import pytest

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.decoder.engine.params import ParamError, SamplingParams, shown_float


@pytest.mark.parametrize(
    ("field", "sent", "echo"),
    [
        ("top_p", -0.1, "must be in (0, 1], got -0.1"),
        ("temperature", 100.3, "must be in [0.0, 100.0], got 100.3"),
        ("min_p", 1.1, "got 1.1"),
        ("repetition_penalty", 10.2, "must be in (0, 10], got 10.2"),
        ("presence_penalty", -2.01, "got -2.01"),
        ("frequency_penalty", 2.7, "got 2.7"),
    ],
)
def test_a_float_field_off_its_range_is_echoed_as_sent_not_as_its_float32(
    field: str, sent: float, echo: str
) -> None:
    on_the_wire = getattr(decoder_pb2.SamplingParams(**{field: sent}), field)
    assert on_the_wire != sent  # the proto's float32 rounded it
    with pytest.raises(ParamError) as error:
        SamplingParams(**{field: on_the_wire}).validate(vocab_size=100)
    assert error.value.field == f"sampling.{field}" and str(error.value).endswith(echo)


def test_a_logit_bias_off_its_range_is_echoed_as_sent() -> None:
    on_the_wire = decoder_pb2.SamplingParams(logit_bias={5: 100.1}).logit_bias[5]
    with pytest.raises(ParamError, match=r"got 100\.1$"):
        SamplingParams(logit_bias={5: on_the_wire}).validate(vocab_size=100)


def test_a_logit_bias_key_outside_the_vocab_is_named_as_its_entry_as_a_bad_value_is() -> None:
    # The key was reported under `sampling.logit_bias`, a bad value under `sampling.logit_bias[3]`.
    with pytest.raises(InvalidArgument) as error:
        SamplingParams(logit_bias={3: 1.0, 100: 1.0}).validate(vocab_size=100)
    assert (error.value.field, error.value.description) == (
        "sampling.logit_bias[100]",
        "token id 100 outside [0, 100)",
    )
    with pytest.raises(ParamError) as error:
        SamplingParams(logit_bias={3: 101.0}).validate(vocab_size=100)
    assert error.value.field == "sampling.logit_bias[3]"


# 2**90's nearest 8 digits (1.2379400e+27) are another float32, 1.2379401e+27 this one: its
# neighbours are not equally far, as at any power of two.
@pytest.mark.parametrize(
    "value", [-0.1, 1e-5, 3.4028235e38, 100.00001, 150.0, -2.5, 1.2379401e27, 1.1754944e-38]
)
def test_the_echo_is_the_shortest_decimal_of_the_same_float32(value: float) -> None:
    float32 = decoder_pb2.SamplingParams(top_p=value).top_p
    assert shown_float(float32) == repr(value)


@pytest.mark.parametrize("value", [0.1, 1e39, float("nan"), float("inf")])
def test_a_value_no_float32_holds_is_shown_whole(value: float) -> None:
    # The in-process API passes doubles: 0.1 is not the float32 0.1, and is shown as Python shows it.
    assert shown_float(value) == repr(value)
