"""An embeddings answer's size, reckoned before any encoder call, is never below what the answer can
take: one row when pooled, else each input's most rows, in the asked encoding."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.gateway.body_limits import BodyLimits
from tandem.gateway.calls import EmbedCall
from tandem.gateway.embed_request import embed_request
from tandem.gateway.embeddings import answer_bound, check_answer_size, check_reply_sizes, float32_values
from tandem.gateway.errors import Refused

INFO = encoder_pb2.EncoderGetModelInfoResponse(hidden_size=64, max_input_tokens=100, num_virtual_tokens=2)
LIMITS = BodyLimits.for_embeddings(100)


def _answer_bytes(call: EmbedCall, rows_per_input: list[int]) -> int:
    """The answer's real size, for inputs that took these many rows (the JSON write_answer writes)."""
    data = []
    for i, num_rows in enumerate(rows_per_input):
        rows = np.full((num_rows, INFO.hidden_size), -1.2345678e-05, dtype="<f4")
        vector = base64.b64encode(rows.tobytes()).decode() if call.is_base64 else rows[0].tolist()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    answer = {"object": "list", "data": data, "model": "m", "usage": {"prompt_tokens": 1, "total_tokens": 1}}
    return len(json.dumps(answer, separators=(",", ":")))


@pytest.mark.parametrize(
    ("body", "rows_per_input"),
    [
        ({"input": ["hello", "a longer text of words"]}, [1, 1]),  # pooled: one row each, as JSON floats
        ({"input": [[5] * 100, "hi"], "tandem_pooling": "none", "encoding_format": "base64"}, [102, 4]),
        ({"input": "é" * 40, "tandem_pooling": "none", "encoding_format": "base64"}, [82]),  # one row a byte
    ],
)
def test_the_bound_is_never_below_the_answer(body: dict, rows_per_input: list[int]) -> None:
    call = embed_request(body | {"model": "m"}, LIMITS)
    assert answer_bound(call, INFO) >= _answer_bytes(call, rows_per_input)


def test_an_answer_over_the_limit_is_413_naming_input() -> None:
    call = embed_request(
        {"input": [[5] * 100] * 4, "tandem_pooling": "none", "encoding_format": "base64"}, LIMITS
    )
    check_answer_size(call, INFO, answer_bound(call, INFO))  # at the bound: served
    with pytest.raises(Refused) as refused:
        check_answer_size(call, INFO, answer_bound(call, INFO) - 1)
    assert (refused.value.error.status, refused.value.error.param) == (413, "input")
    assert "--max-embeddings-bytes" in refused.value.error.message


def test_token_ids_whose_reply_is_over_the_message_cap_are_413_naming_the_input_before_any_call() -> None:
    # 64 IDs x 64 values x 4 bytes = 16384 bytes of rows, plus at least a byte an ID: the encoder's reply
    # (17039 bytes live) was refused by the gateway's channel after the call, named as a picture.
    info = encoder_pb2.EncoderGetModelInfoResponse(hidden_size=64, max_input_tokens=100)
    body = {"input": ["hi", list(range(5, 69))], "tandem_pooling": "none", "encoding_format": "base64"}
    call = embed_request(body, LIMITS)
    check_reply_sizes(call, info, 16384 + 64)  # rows and IDs at the cap: sent
    with pytest.raises(Refused) as refused:
        check_reply_sizes(call, info, 16384 + 63)
    assert (refused.value.error.status, refused.value.error.param) == (413, "input[1]")
    assert refused.value.error.message == (
        "input[1]: its reply from the encoder is at least 16448 bytes (64 rows x 64 values x 4 bytes, and "
        "its 64 token IDs), over the gateway's --max-message-bytes of 16447; send fewer token IDs, or pool "
        "them (tandem_pooling mean)"
    )
    check_reply_sizes(embed_request(body | {"tandem_pooling": "mean"}, LIMITS), info, 16384)  # one row


def test_a_rows_json_floats_are_numpys_reading_of_the_little_endian_bytes() -> None:
    finfo = np.finfo(np.float32)
    extremes = [0.0, -0.0, 1.0, -1.2345678e-05, finfo.max, -finfo.max, finfo.tiny, finfo.smallest_subnormal]
    row = np.concatenate(
        [np.array(extremes, dtype="<f4"), np.random.default_rng(0).standard_normal(64, "<f4")]
    )
    values = float32_values(row.tobytes())
    assert values == row.tolist() and all(type(v) is float for v in values)
    assert json.dumps(values) == json.dumps(row.tolist())
