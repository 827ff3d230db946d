"""An encoder's model is this decoder's when its token table sample matches within rounding (whatever the
name it serves it under); another model of the same shape, or of another shape, is refused in words that
name both models, the encoder and the flag that mends it. With no sample on either side nothing is
compared. A reply's sample found this decoder's is compared once, then known by its bytes, for at most
MAX_SAME_SAMPLES samples. (The GetModelInfo and Embed calls that carry the samples, between real
services, are tests/integration/encoder/test_decoder_checks_the_encoders_model.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.common.torch_part.model_identity import NUM_COLUMNS, NUM_ROWS, TableSample
from tandem.decoder.api.encoder_model_check import MAX_SAME_SAMPLES, EncoderModelCheck

ADDRESS = "127.0.0.1:50052"
MODEL_DIR = Path("/models/tiny-ours")
OURS = TableSample(1024, 64, tuple(torch.linspace(-1.0, 1.0, NUM_ROWS * NUM_COLUMNS).tolist()))


def _pb(sample: TableSample) -> encoder_pb2.TokenTableSample:
    return encoder_pb2.TokenTableSample(
        vocab_size=sample.vocab_size, hidden_size=sample.hidden_size, values=sample.values
    )


def _check(model_name: str = "tiny") -> EncoderModelCheck:
    return EncoderModelCheck(ADDRESS, OURS, MODEL_DIR, model_name)


def _rounded(sample: TableSample, dtype: torch.dtype) -> TableSample:
    values = torch.tensor(sample.values).to(dtype).float().tolist()
    return TableSample(sample.vocab_size, sample.hidden_size, tuple(values))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_same_table_stored_in_any_dtype_under_any_name_is_this_decoders_model(dtype: torch.dtype) -> None:
    theirs = _pb(_rounded(OURS, dtype))
    check = _check()
    assert check.mismatch("another-name", theirs) is None
    assert (
        check.info_mismatch(encoder_pb2.EncoderGetModelInfoResponse(model="x", token_table_sample=theirs))
        is None
    )
    assert check.reply_mismatch(encoder_pb2.EmbedResponse(model="x", token_table_sample=theirs)) is None


def test_another_table_of_the_same_shape_is_refused_naming_both_models_and_the_flag() -> None:
    theirs = TableSample(1024, 64, tuple(-value for value in OURS.values))
    reply = encoder_pb2.EmbedResponse(model="tiny-other", token_table_sample=_pb(theirs))
    mismatch = _check().reply_mismatch(reply)
    assert mismatch is not None
    assert mismatch.said == (
        f"encoder {ADDRESS} serves model 'tiny-other', not this decoder's 'tiny' ({MODEL_DIR}): same token "
        "table shape [1024, 64], different values, so its rows would be read in the wrong model's hidden "
        "space; start the encoder with this decoder's --model"
    )
    # A caller's words name the two models, not this host's layout (the gateway passes them on).
    assert mismatch.told == (
        "the encoder serves model 'tiny-other', not this decoder's 'tiny': same token table shape "
        "[1024, 64], different values, so its rows would be read in the wrong model's hidden space"
    )


def test_of_encoders_balanced_the_refusal_names_the_replica_that_answered_not_the_list() -> None:
    """It named "encoder 127.0.0.1:50052,127.0.0.1:50053", the right one with the wrong."""
    theirs = TableSample(1024, 64, tuple(-value for value in OURS.values))
    reply = encoder_pb2.EmbedResponse(model="tiny-other", token_table_sample=_pb(theirs))
    info = encoder_pb2.EncoderGetModelInfoResponse(model="tiny-other", token_table_sample=_pb(theirs))
    check = EncoderModelCheck(f"{ADDRESS},127.0.0.1:50053", OURS, MODEL_DIR, "tiny")
    for mismatch in (
        check.reply_mismatch(reply, "127.0.0.1:50053"),
        check.info_mismatch(info, "127.0.0.1:50053"),
    ):
        assert mismatch is not None and mismatch.said.startswith(
            "encoder 127.0.0.1:50053 serves model 'tiny-other'"
        )
        assert "127.0.0.1" not in mismatch.told
    unsaid = check.reply_mismatch(reply)
    assert unsaid is not None and unsaid.said.startswith(
        f"encoder {ADDRESS},127.0.0.1:50053 serves"
    )  # none said


def test_a_table_of_another_shape_is_refused_naming_both_shapes_and_the_directorys_name_when_unnamed() -> (
    None
):
    theirs = TableSample(2048, 64, OURS.values)
    info = encoder_pb2.EncoderGetModelInfoResponse(model="big", token_table_sample=_pb(theirs))
    mismatch = _check(model_name="").info_mismatch(info)
    assert mismatch is not None
    assert mismatch.said == (
        f"encoder {ADDRESS} serves model 'big', not this decoder's 'tiny-ours' ({MODEL_DIR}): token table "
        "[2048, 64] against [1024, 64], so its rows would be read in the wrong model's hidden space; start "
        "the encoder with this decoder's --model"
    )
    assert mismatch.told == (
        "the encoder serves model 'big', not this decoder's 'tiny-ours': token table [2048, 64] against "
        "[1024, 64], so its rows would be read in the wrong model's hidden space"
    )


def test_nothing_is_compared_without_a_sample_on_either_side() -> None:
    theirs = _pb(TableSample(2048, 64, OURS.values))
    unchecked = EncoderModelCheck(ADDRESS, None, None, "")
    assert unchecked.reply_mismatch(encoder_pb2.EmbedResponse(model="big", token_table_sample=theirs)) is None
    assert _check().reply_mismatch(encoder_pb2.EmbedResponse(model="big")) is None  # an older encoder
    assert _check().info_mismatch(encoder_pb2.EncoderGetModelInfoResponse(model="big")) is None


def test_a_replys_sample_found_this_decoders_is_compared_once_for_at_most_max_same_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check = _check()
    compared: list[str] = []  # the models whose samples were compared value by value
    mismatch = check.mismatch

    def counted(
        model: str, reported: encoder_pb2.TokenTableSample | None, replica: str | None = None
    ) -> str | None:
        compared.append(model)
        return mismatch(model, reported, replica)

    monkeypatch.setattr(check, "mismatch", counted)
    # Distinct samples, each within rounding of ours (one more than are remembered), and another model's.
    samples = [
        TableSample(1024, 64, tuple(value * (1 + i * 2.0**-12) for value in OURS.values))
        for i in range(MAX_SAME_SAMPLES + 1)
    ]
    replies = [
        encoder_pb2.EmbedResponse(model=f"s{i}", token_table_sample=_pb(s)) for i, s in enumerate(samples)
    ]
    other = encoder_pb2.EmbedResponse(
        model="other", token_table_sample=_pb(TableSample(1024, 64, tuple(-v for v in OURS.values)))
    )
    for _ in range(2):
        assert [check.reply_mismatch(reply) for reply in replies] == [None] * len(replies)
        assert check.reply_mismatch(other) is not None
    assert compared == [reply.model for reply in replies] + ["other", f"s{MAX_SAME_SAMPLES}", "other"]


def test_a_model_under_a_remembered_models_name_is_still_compared_and_refused() -> None:
    # An encoder restarted on its port with another checkpoint keeps its --model-name: only the sample
    # may decide, so the name of a sample once found the same remembers nothing.
    check = _check()
    good = encoder_pb2.EmbedResponse(model="same-name", token_table_sample=_pb(OURS))
    wrong = encoder_pb2.EmbedResponse(
        model="same-name", token_table_sample=_pb(TableSample(1024, 64, tuple(-v for v in OURS.values)))
    )
    assert check.reply_mismatch(good) is None
    assert [check.reply_mismatch(wrong) is not None for _ in range(3)] == [True, True, True]


def test_a_mismatching_sample_is_never_remembered_even_with_room_to_remember_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check = _check()
    compared: list[str] = []
    mismatch = check.mismatch

    def counted(
        model: str, reported: encoder_pb2.TokenTableSample | None, replica: str | None = None
    ) -> str | None:
        compared.append(model)
        return mismatch(model, reported, replica)

    monkeypatch.setattr(check, "mismatch", counted)
    other = encoder_pb2.EmbedResponse(
        model="other", token_table_sample=_pb(TableSample(1024, 64, tuple(-v for v in OURS.values)))
    )
    assert [check.reply_mismatch(other) is not None for _ in range(2)] == [True, True]
    assert compared == ["other", "other"]
