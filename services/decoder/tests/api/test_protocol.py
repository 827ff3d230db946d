"""Proto <-> engine conversion: prompt logprobs (the option in, the entries out, unset fields as marks),
each token's own bytes with logprobs, the field paths of what cannot be converted, and max_new_tokens
as the stopping criteria give it (its default, and cap_to_context)."""

from __future__ import annotations

import pytest

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2, tensor_pb2
from tandem.common.torch_part import tensors
from tandem.decoder.api.protocol import event_to_pb, spec_from_pb
from tandem.decoder.engine.outputs.outputs import Delta, TopLogprobs
from tandem.decoder.engine.outputs.prompt_logprobs import PromptLogprob
from tandem.decoder.engine.outputs.token_bytes import TokenBytes, token_bytes_table
from tandem.decoder.models.loader import LoadedModel

from ..engine.admission.test_prompt import _build
from ..engine.outputs.test_detokenizer import BYTE_LEVEL, EOS


def _request(**output: int) -> decoder_pb2.GenerateRequest:
    request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(text="hi")])
    for name, value in output.items():
        setattr(request.output, name, value)
    return request


def test_prompt_logprobs_is_off_when_unset_and_its_value_is_the_top_n_when_set() -> None:
    def prompt_logprobs(request: decoder_pb2.GenerateRequest) -> int | None:
        return spec_from_pb(request, tensors.DEFAULT_LIMITS, None).sampling.prompt_logprobs

    assert prompt_logprobs(_request()) is None
    assert prompt_logprobs(_request(prompt_logprobs=0)) == 0  # set to 0: the tokens' own logprobs only
    assert prompt_logprobs(_request(prompt_logprobs=7)) == 7


def test_entries_leave_unset_what_a_position_lacks() -> None:
    delta = Delta(
        "r",
        (9,),
        "",
        (),
        (),
        prompt_logprobs=(
            PromptLogprob(11, None, (), ()),  # position 0: no context
            PromptLogprob(None, None, (4, 5), (-0.5, -1.5)),  # an embedding row: no token
            PromptLogprob(12, -2.25, (4, 12), (-0.25, -2.25), rank=2),
        ),
    )
    first, row, token = event_to_pb(delta).delta.prompt_logprobs
    assert first.HasField("token_id") and first.token_id == 11
    assert not first.HasField("logprob") and not first.HasField("top_logprobs") and not first.HasField("rank")
    assert not row.HasField("token_id") and not row.HasField("logprob") and not row.HasField("rank")
    assert list(row.top_logprobs.token_ids) == [4, 5] and list(row.top_logprobs.logprobs) == [-0.5, -1.5]
    assert (token.token_id, token.logprob, token.rank) == (12, -2.25, 2)
    assert list(token.top_logprobs.token_ids) == [4, 12]


def test_a_delta_without_them_sends_none() -> None:
    assert not event_to_pb(Delta("r", (9,), "x", (), ())).delta.prompt_logprobs


def _delta(text: str, with_logprobs: bool = True) -> Delta:
    """A delta of `text`'s tokens (BYTE_LEVEL's), each with logprobs and two alternatives when asked."""
    ids = tuple(BYTE_LEVEL.encode(text).ids)
    if not with_logprobs:
        return Delta("r", ids, text, (), ())
    top = tuple(TopLogprobs((i, BYTE_LEVEL.token_to_id(EOS)), (-0.5, -2.0)) for i in ids)
    return Delta("r", ids, text, tuple(-0.5 for _ in ids), top)


def test_a_merged_delta_carries_each_tokens_own_bytes_which_join_to_its_text() -> None:
    # A reader behind gets its queued deltas as one (engine/front/streaming.py): one entry per token
    # still, not the whole text on the first.
    merged = _delta("hello world").followed_by(_delta(", hello again"))
    message = event_to_pb(merged, token_bytes_table(BYTE_LEVEL)).delta
    assert len(message.token_ids) > 2 and len(message.token_bytes) == len(message.token_ids)
    assert b"".join(message.token_bytes) == b"hello world, hello again" == message.text.encode()
    for k, top in enumerate(message.top_logprobs):  # each alternative spelled too
        assert top.token_bytes == [message.token_bytes[k], EOS.encode()]


def test_a_delta_without_logprobs_or_a_table_carries_no_bytes() -> None:
    assert not event_to_pb(
        _delta("hello", with_logprobs=False), token_bytes_table(BYTE_LEVEL)
    ).delta.token_bytes
    message = event_to_pb(_delta("hello")).delta
    assert not message.token_bytes and not message.top_logprobs[0].token_bytes


def test_a_chat_parts_tensor_errors_name_the_part_not_a_prompt_segment() -> None:
    # Issue 32: a chat embedding part was refused under `prompt[1]...`.

    bad = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[2, 4], data=bytes(7))
    parts = [decoder_pb2.ChatContentPart(text="see"), decoder_pb2.ChatContentPart(embeddings=bad)]
    request = decoder_pb2.GenerateRequest(
        chat=decoder_pb2.ChatPrompt(messages=[decoder_pb2.ChatMessage(role="user", content=parts)])
    )
    with pytest.raises(InvalidArgument) as caught:
        spec_from_pb(request, tensors.DEFAULT_LIMITS, None)
    assert caught.value.field.startswith("chat.messages[0].content[1].embeddings"), caught.value.field


def test_a_chat_messages_name_is_kept_and_an_unnamed_one_has_none() -> None:
    request = decoder_pb2.GenerateRequest()
    request.chat.messages.add(role="user", name="alice").content.add(text="hi")
    request.chat.messages.add(role="user").content.add(text="yo")
    named, unnamed = spec_from_pb(request, tensors.DEFAULT_LIMITS, None).chat.messages
    assert (named.name, unnamed.name) == ("alice", None)


def test_an_encoder_part_is_converted_unfetched_and_an_empty_one_names_its_field() -> None:
    from tandem.client.pb.tandem.v1 import encoder_pb2
    from tandem.common.torch_part.prompt_parts import EncoderPrompt

    request = decoder_pb2.GenerateRequest(
        prompt=[
            decoder_pb2.PromptSegment(encoder=encoder_pb2.EncoderInput(text="a cat")),
            decoder_pb2.PromptSegment(
                encoder=encoder_pb2.EncoderInput(token_ids=tensor_pb2.TokenIds(ids=[3]))
            ),
        ]
    )
    text, ids = spec_from_pb(request, tensors.DEFAULT_LIMITS, None).prompt
    assert text == EncoderPrompt("text", "a cat") and text.rows is None
    assert (ids.kind, list(ids.content)) == ("token_ids", [3])
    chat = decoder_pb2.GenerateRequest()
    chat.chat.messages.add(role="user").content.add(
        encoder=encoder_pb2.EncoderInput(image=encoder_pb2.Image(data=b"png"))
    )
    [image] = spec_from_pb(chat, tensors.DEFAULT_LIMITS, None).chat.messages[0].content
    assert image.is_image and image.content == b"png"
    empty = decoder_pb2.GenerateRequest(
        prompt=[decoder_pb2.PromptSegment(encoder=encoder_pb2.EncoderInput())]
    )
    with pytest.raises(InvalidArgument, match=r"^prompt\[0\]\.encoder: set one of text, token_ids or image$"):
        spec_from_pb(empty, tensors.DEFAULT_LIMITS, None)


def test_entries_spell_each_token_by_its_own_bytes_as_a_deltas_tokens_are() -> None:
    delta = Delta(
        "r",
        (9,),
        "",
        (),
        (),
        prompt_logprobs=(
            PromptLogprob(1, None, (), ()),
            PromptLogprob(None, None, (2, 1), (-0.5, -1.5)),  # an embedding row: its alternatives only
            PromptLogprob(3, -2.25, (1, 3), (-0.25, -2.25)),
        ),
    )
    table = TokenBytes((b"<s>", b" a", "\u00e9".encode()[:1], b"b"))
    first, row, token = event_to_pb(delta, table).delta.prompt_logprobs
    assert first.token_bytes == b" a" and not first.top_logprobs.token_bytes
    assert not row.HasField("token_bytes") and list(row.top_logprobs.token_bytes) == [b"\xc3", b" a"]
    assert token.token_bytes == b"b" and list(token.top_logprobs.token_bytes) == [b" a", b"b"]
    unspelled = event_to_pb(delta).delta.prompt_logprobs[2]  # no table: nothing, as an older decoder's
    assert not unspelled.HasField("token_bytes") and not unspelled.top_logprobs.token_bytes


def _stopping(**stopping: int | bool) -> decoder_pb2.GenerateRequest:
    request = decoder_pb2.GenerateRequest(
        prompt=[decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=list(range(10))))]
    )
    for name, value in stopping.items():
        setattr(request.stopping, name, value)
    return request


def _max_new_tokens(loaded: LoadedModel, request: decoder_pb2.GenerateRequest) -> int:
    """max_new_tokens of `request` (a prompt of 10 positions) built in a context of 1,000: room for more
    than the default 256."""
    spec = spec_from_pb(request, tensors.DEFAULT_LIMITS, None)
    return _build(loaded, spec, max_model_len=1000).stopping.max_new_tokens


def test_cap_to_context_without_max_new_tokens_runs_until_the_context_is_full_not_256(
    tiny_fp32: LoadedModel,
) -> None:
    assert _max_new_tokens(tiny_fp32, _stopping(cap_to_context=True)) == 1000 - 10
    assert _max_new_tokens(tiny_fp32, _stopping()) == 256  # a gRPC caller's default stays


def test_cap_to_context_caps_a_max_new_tokens_that_does_not_fit_which_is_refused_without_it(
    tiny_fp32: LoadedModel,
) -> None:
    assert _max_new_tokens(tiny_fp32, _stopping(cap_to_context=True, max_new_tokens=5000)) == 990
    assert _max_new_tokens(tiny_fp32, _stopping(cap_to_context=True, max_new_tokens=16)) == 16
    with pytest.raises(InvalidArgument) as refused:
        _max_new_tokens(tiny_fp32, _stopping(max_new_tokens=5000))
    assert refused.value.field == "stopping.max_new_tokens"


def test_cap_to_context_refuses_a_min_new_tokens_the_context_cannot_hold_rather_than_shrink_it(
    tiny_fp32: LoadedModel,
) -> None:
    """vLLM's min_tokens past the room the prompt leaves is a 400 whether max_tokens was sent or not;
    shrunk, the answer ran to the context's end and ended `length` short of what was asked."""
    for unmet in (
        _stopping(cap_to_context=True, min_new_tokens=991),
        _stopping(cap_to_context=True, max_new_tokens=5000, min_new_tokens=5000),
    ):
        with pytest.raises(InvalidArgument) as refused:
            _max_new_tokens(tiny_fp32, unmet)
        assert refused.value.field == "stopping.min_new_tokens"
        assert "must be at most 990" in str(refused.value)
    spec = spec_from_pb(_stopping(cap_to_context=True, min_new_tokens=990), tensors.DEFAULT_LIMITS, None)
    stopping = _build(tiny_fp32, spec, max_model_len=1000).stopping
    assert (stopping.min_new_tokens, stopping.max_new_tokens) == (990, 990)
