"""Request building: every rule once, cheapest first, the same for the gRPC and in-process fronts."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import pytest
import torch

from tandem.client.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from tandem.common import text_bounds
from tandem.decoder.engine.admission.chat import MAX_NAME_CHARS, ChatMessage, ChatRequest, ChatTemplate
from tandem.decoder.engine.admission.prompt import (
    EmbeddingPrompt,
    EncoderPrompt,
    GenerateSpec,
    TextPrompt,
    build_request,
    check_spec,
)
from tandem.decoder.engine.admission.template_kwargs import MAX_KWARGS_CHARS
from tandem.decoder.engine.params import StoppingParams, StructuredOutput
from tandem.decoder.engine.request import Request
from tandem.decoder.models.loader import LoadedModel


def _build(loaded: LoadedModel, spec: GenerateSpec, max_model_len: int = 16, embeds: bool = True) -> Request:
    max_token_chars = text_bounds.max_token_chars(loaded.tokenizer)
    template = None
    if spec.chat is not None:
        template = ChatTemplate(
            "{% for m in messages %}{{ m['content'] }}\n{% endfor %}", loaded.tokenizer, {}
        )
    return build_request(
        spec,
        "r",
        loaded.tokenizer,
        loaded.config,
        max_model_len,
        embeds,
        template,
        max_token_chars=max_token_chars,
    )


def _field(loaded: LoadedModel, spec: GenerateSpec, **kwargs) -> str:
    with pytest.raises(InvalidArgument) as info:
        _build(loaded, spec, **kwargs)
    return info.value.field


def test_a_request_over_max_model_len_names_what_asks_too_much(tiny_fp32: LoadedModel) -> None:
    fits_alone = GenerateSpec([list(range(10))], stopping=StoppingParams(max_new_tokens=7))
    assert _field(tiny_fp32, fits_alone) == "stopping.max_new_tokens"
    assert (
        _field(tiny_fp32, GenerateSpec([list(range(16))], stopping=StoppingParams(max_new_tokens=1)))
        == "prompt"
    )
    assert _build(tiny_fp32, GenerateSpec([list(range(10))], stopping=StoppingParams(max_new_tokens=6)))


def test_a_default_max_new_tokens_shrinks_to_the_context(tiny_fp32: LoadedModel) -> None:
    spec = GenerateSpec([list(range(10))], cap_max_new_tokens=True)
    assert _build(tiny_fp32, spec).stopping.max_new_tokens == 6


def test_a_min_new_tokens_the_context_cannot_hold_is_refused_not_shrunk_with_a_default_max(
    tiny_fp32: LoadedModel,
) -> None:
    """The default 256 is shrunk to the 6 positions a 10-position prompt leaves of 16; a min_new_tokens
    of 7 cannot be met there, as it cannot with max_new_tokens sent."""
    spec = GenerateSpec([list(range(10))], stopping=StoppingParams(min_new_tokens=7), cap_max_new_tokens=True)
    assert _field(tiny_fp32, spec) == "stopping.min_new_tokens"
    fits = dataclasses.replace(spec, stopping=StoppingParams(min_new_tokens=6))
    assert _build(tiny_fp32, fits).stopping.min_new_tokens == 6


def test_embeddings_are_cast_to_the_model_dtype_once_and_must_be_finite(tiny_fp32: LoadedModel) -> None:
    hidden = tiny_fp32.config.hidden_size
    rows = EmbeddingPrompt(torch.ones(2, hidden, dtype=torch.bfloat16))
    request = _build(tiny_fp32, GenerateSpec([rows], cap_max_new_tokens=True))
    assert request.embedding_spans[0].rows.dtype == tiny_fp32.config.dtype
    nan = torch.full((1, hidden), float("nan"))
    assert _field(tiny_fp32, GenerateSpec([EmbeddingPrompt(nan)], cap_max_new_tokens=True)) == (
        "prompt[0].embeddings.data"
    )


def test_cheap_rules_are_checked_before_any_position_is_read(tiny_fp32: LoadedModel) -> None:
    hidden = tiny_fp32.config.hidden_size
    nan = EmbeddingPrompt(torch.full((3, hidden), float("nan")))
    assert _field(tiny_fp32, GenerateSpec([nan, TextPrompt("")])) == "prompt[1].text"
    assert _field(tiny_fp32, GenerateSpec([[10**9], EmbeddingPrompt(torch.ones(1, 3))])) == (
        "prompt[1].embeddings.shape"
    )
    with pytest.raises(FailedPrecondition):
        _build(tiny_fp32, GenerateSpec([[10**9], nan]), embeds=False)


def test_an_empty_prompt_is_refused_naming_the_prompt(tiny_fp32: LoadedModel) -> None:
    assert _field(tiny_fp32, GenerateSpec([], cap_max_new_tokens=True)) == "prompt"


@pytest.mark.parametrize(
    ("dtype", "overflowing"),
    [
        (torch.bfloat16, torch.finfo(torch.float32).max),  # 3.4e38 rounds up to bf16 inf
        (torch.float16, 65_520.0),  # anything that rounds past fp16's max, 65,504
    ],
)
def test_embedding_values_finite_on_the_wire_but_infinite_in_the_model_dtype_are_refused(
    tiny_fp32: LoadedModel, dtype: torch.dtype, overflowing: float
) -> None:
    # Accepted, such rows gave NaN keys and values, tokens [0, 0, 0, 0] and NaN logprobs.
    model = dataclasses.replace(tiny_fp32, config=dataclasses.replace(tiny_fp32.config, dtype=dtype))
    hidden = model.config.hidden_size
    rows = torch.zeros(2, hidden)
    rows[1, 3] = overflowing
    assert bool(torch.isfinite(rows).all())  # finite as sent, in float32
    with pytest.raises(InvalidArgument) as info:
        _build(model, GenerateSpec([[1], EmbeddingPrompt(rows)], cap_max_new_tokens=True))
    assert info.value.field == "prompt[1].embeddings.data"
    assert "[1, 3]" in info.value.description and str(dtype).removeprefix("torch.") in info.value.description
    largest = torch.finfo(dtype).max
    rows[1, 3] = -largest  # the edge itself is finite in the model dtype
    request = _build(model, GenerateSpec([[1], EmbeddingPrompt(rows)], cap_max_new_tokens=True))
    assert float(request.embedding_spans[0].rows[1, 3]) == -largest


def test_embedding_values_not_finite_as_sent_are_named_in_the_dtype_they_were_sent_in(
    tiny_fp32: LoadedModel,
) -> None:
    # Cast to the model's float32 first, an fp16 Inf was reported "as float32", with float32's range.
    rows = torch.zeros(2, tiny_fp32.config.hidden_size, dtype=torch.float16)
    rows[1, 3] = float("-inf")
    with pytest.raises(InvalidArgument) as info:
        _build(tiny_fp32, GenerateSpec([[1], EmbeddingPrompt(rows)], cap_max_new_tokens=True))
    assert (info.value.field, info.value.description) == (
        "prompt[1].embeddings.data",
        "contains NaN or Inf as sent, in float16 (first at index [1, 3]); values must be finite",
    )


class _NoTokenizing:
    """A tokenizer that fails the test if anything is tokenized."""

    def __init__(self, real) -> None:
        self.real = real

    def encode_batch(self, *args, **kwargs):
        raise AssertionError("tokenized a prompt its length alone rules out")

    def get_vocab(self, *args, **kwargs):
        return self.real.get_vocab(*args, **kwargs)

    @property
    def decoder(self):
        return self.real.decoder


def test_a_text_too_long_to_fit_is_refused_from_its_length_before_it_is_tokenized(
    tiny_fp32: LoadedModel,
) -> None:
    # Tokenizing 30 MB of text took the decoder 24 s, all of it before the length rule applied.
    max_chars = text_bounds.max_token_chars(tiny_fp32.tokenizer)
    untokenizable = dataclasses.replace(tiny_fp32, tokenizer=_NoTokenizing(tiny_fp32.tokenizer))
    spec = GenerateSpec([[1, 2], TextPrompt("a" * (14 * max_chars))], cap_max_new_tokens=True)
    with pytest.raises(InvalidArgument) as info:
        _build(untokenizable, spec)  # 2 ids + at least 14 positions of text >= 16
    assert info.value.field == "prompt" and "at least 16 positions" in info.value.description
    # One character less per bound and the text may fit: it is tokenized, and here it does fit.
    fits = GenerateSpec([[1, 2], TextPrompt("a" * (13 * max_chars))], cap_max_new_tokens=True)
    assert _build(tiny_fp32, fits, max_model_len=4096).num_prompt_tokens < 4096


def test_token_ids_and_rows_are_counted_before_any_is_read(tiny_fp32: LoadedModel) -> None:
    hidden = tiny_fp32.config.hidden_size
    out_of_vocab = [10**9] * 20  # each id would be refused, but the count comes first
    assert _field(tiny_fp32, GenerateSpec([out_of_vocab])) == "prompt"
    nan_rows = EmbeddingPrompt(torch.full((20, hidden), float("nan")))
    assert _field(tiny_fp32, GenerateSpec([nan_rows])) == "prompt"


def _chat(*contents: list) -> GenerateSpec:
    chat = ChatRequest([ChatMessage("user", content) for content in contents])
    return GenerateSpec([], chat=chat, cap_max_new_tokens=True)


def test_chat_parts_obey_the_segment_rules_and_errors_name_where_the_caller_put_them(
    tiny_fp32: LoadedModel,
) -> None:
    hidden, vocab = tiny_fp32.config.hidden_size, tiny_fp32.config.vocab_size
    assert (
        _field(tiny_fp32, _chat([TextPrompt("a")], [[1], []])) == "chat.messages[1].content[1].token_ids.ids"
    )
    assert _field(tiny_fp32, _chat([EmbeddingPrompt(torch.ones(1, 3))])) == (
        "chat.messages[0].content[0].embeddings.shape"
    )
    assert _field(tiny_fp32, _chat([TextPrompt("a")], [[1, vocab]])) == (
        "chat.messages[1].content[0].token_ids.ids[1]"
    )
    nan = EmbeddingPrompt(torch.full((1, hidden), float("nan")))
    assert _field(tiny_fp32, _chat([TextPrompt("a")], [TextPrompt("b"), nan])) == (
        "chat.messages[1].content[1].embeddings.data"
    )
    assert _field(tiny_fp32, _chat([list(range(16))])) == "chat"  # the length bound, from sizes alone
    with pytest.raises(FailedPrecondition):
        _build(tiny_fp32, _chat([nan]), embeds=False)


def test_an_images_rows_that_overflow_are_named_as_the_image_part(tiny_fp32: LoadedModel) -> None:
    # Its shape errors said image; its values' said embeddings, a part the caller never sent.
    template = ChatTemplate(
        "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<img>{% else %}"
        "{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}",
        tiny_fp32.tokenizer, {}, image_placeholder="<img>",
    )  # fmt: skip
    nan = EmbeddingPrompt(torch.full((2, tiny_fp32.config.hidden_size), float("nan")), is_image=True)
    spec = GenerateSpec(
        [], chat=ChatRequest([ChatMessage("user", [TextPrompt("a"), nan])]), cap_max_new_tokens=True
    )
    with pytest.raises(InvalidArgument) as error:
        build_request(
            spec, "r", tiny_fp32.tokenizer, tiny_fp32.config, 64, True, template, max_token_chars=64
        )
    assert error.value.field == "chat.messages[0].content[1].image.data"


def test_an_empty_text_in_a_chat_is_a_turn_with_nothing_said(tiny_fp32: LoadedModel) -> None:
    # OpenAI and vLLM take a system prompt of "": the template renders the turn, empty.
    chat = ChatRequest([ChatMessage("system", [TextPrompt("")]), ChatMessage("user", [TextPrompt("hi")])])
    empty = _build(tiny_fp32, GenerateSpec([], chat=chat, cap_max_new_tokens=True), max_model_len=64)
    alone = _build(tiny_fp32, _chat([TextPrompt("hi")]), max_model_len=64)
    assert len(empty.prompt_token_ids) > len(alone.prompt_token_ids)  # the system turn is there
    assert _field(tiny_fp32, _chat([])) == "chat.messages[0].content"  # a message still has a part


def test_a_chat_flattens_like_the_same_parts_sent_as_segments(tiny_fp32: LoadedModel) -> None:
    rows = EmbeddingPrompt(torch.ones(2, tiny_fp32.config.hidden_size))
    chat = _build(tiny_fp32, _chat([[5, 6], rows]), max_model_len=64)
    newline = tiny_fp32.tokenizer.encode("\n", add_special_tokens=False).ids
    segments = _build(
        tiny_fp32, GenerateSpec([[5, 6], rows, newline], cap_max_new_tokens=True), max_model_len=64
    )
    assert chat.prompt_token_ids == segments.prompt_token_ids
    assert chat.is_token_ids == segments.is_token_ids
    assert chat.embedding_digests == segments.embedding_digests


# -- encoder parts: rows the decoder fetches while the request is built -------------------------------


def _fetched(rows: torch.Tensor | BaseException | None) -> EncoderPrompt:
    """An encoder part whose fetch has settled with `rows` (or failed); None: never settles."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if isinstance(rows, BaseException):
        future.set_exception(rows)
    elif rows is not None:
        future.set_result(rows)
    return EncoderPrompt("image", b"picture bytes", future)


def _spec(*parts, **fields) -> GenerateSpec:
    return GenerateSpec(list(parts), cap_max_new_tokens=True, **fields)


def test_an_encoder_parts_rows_are_positions_as_an_embeddings_parts_are(tiny_fp32: LoadedModel) -> None:
    rows = torch.randn(3, tiny_fp32.config.hidden_size)
    fetched = _build(tiny_fp32, _spec([1, 2], _fetched(rows), [3]))
    given = _build(tiny_fp32, _spec([1, 2], EmbeddingPrompt(rows), [3]))
    assert fetched.is_token_ids == given.is_token_ids == [True, True, False, False, False, True]
    assert fetched.embedding_digests == given.embedding_digests


def test_a_decoder_without_an_encoder_refuses_an_encoder_part_naming_the_flag(tiny_fp32: LoadedModel) -> None:
    with pytest.raises(FailedPrecondition) as info:
        _build(tiny_fp32, _spec([1], EncoderPrompt("text", "hello")))
    assert str(info.value) == "prompt[1].encoder: this decoder has no encoder; start it with --encoder ADDR"
    empty = dataclasses.replace(_fetched(None), kind="token_ids", content=[])
    with pytest.raises(InvalidArgument, match=r"prompt\[0\]\.encoder\.token_ids\.ids: must not be empty"):
        _build(tiny_fp32, _spec(empty))


def test_an_encoder_parts_rows_must_be_the_models_width_and_finite(tiny_fp32: LoadedModel) -> None:
    hidden = tiny_fp32.config.hidden_size
    assert _field(tiny_fp32, _spec(_fetched(torch.randn(2, hidden + 1)))) == "prompt[0].encoder"
    bad = torch.randn(2, hidden)
    bad[1, 3] = float("nan")
    assert _field(tiny_fp32, _spec(_fetched(bad))) == "prompt[0].encoder.data"


def test_rows_that_leave_no_room_end_the_request_without_waiting_for_the_other_fetches(
    tiny_fp32: LoadedModel,
) -> None:
    # The call's end cancels the fetches still running: one request of many pictures no longer has
    # every one through the encoder's tower before the context refuses it.
    never = _fetched(None)
    full = _spec(
        _fetched(torch.randn(15, tiny_fp32.config.hidden_size)), never, deadline=time.monotonic() + 5
    )
    with pytest.raises(InvalidArgument, match=r"^prompt: at least 16 positions \(1 encoder parts not yet"):
        _build(tiny_fp32, full)
    assert not never.rows.done()
    fits = _spec(
        _fetched(torch.randn(14, tiny_fp32.config.hidden_size)),
        _fetched(torch.randn(1, tiny_fp32.config.hidden_size)),
    )
    assert _build(tiny_fp32, fits).num_prompt_tokens == 15


def test_an_encoder_text_too_long_for_the_context_is_refused_naming_it_without_waiting_for_its_rows(
    tiny_fp32: LoadedModel,
) -> None:
    # Counted at one position, it was embedded and then refused naming the encoder's max_input_tokens
    # (8192) where this decoder's context was 1007.
    max_chars = text_bounds.max_token_chars(tiny_fp32.tokenizer)
    never = dataclasses.replace(
        _fetched(None), kind="text", content="a" * (16 * max_chars), counts_as_input=True
    )
    with pytest.raises(InvalidArgument) as info:
        _build(tiny_fp32, _spec(never, deadline=time.monotonic() + 1))  # waited for: DEADLINE_EXCEEDED
    assert info.value.field == "prompt" and "at least 16 positions" in info.value.description
    assert "max_model_len 16" in info.value.description and not never.rows.done()


def test_an_encoder_part_of_unknown_rows_counts_at_one_and_its_rows_decide(tiny_fp32: LoadedModel) -> None:
    # Rows pooled by the encoder, or of a tokenizer of its own (a projector): 2,000 token IDs were
    # refused "at least 2001 positions" where one row came.
    row = torch.randn(1, tiny_fp32.config.hidden_size)
    ids = dataclasses.replace(_fetched(row), kind="token_ids", content=[7] * 2000)
    text = dataclasses.replace(_fetched(row), kind="text", content="word " * 3000)
    assert _build(tiny_fp32, _spec(ids, [5], text)).num_prompt_tokens == 3


def test_a_refusal_from_sizes_says_how_each_kind_of_part_counted(tiny_fp32: LoadedModel) -> None:
    counted = dataclasses.replace(_fetched(None), kind="token_ids", content=[7] * 20, counts_as_input=True)
    with pytest.raises(InvalidArgument) as info:
        _build(tiny_fp32, _spec(counted, _fetched(None)))
    assert info.value.description.startswith(
        "at least 21 positions (a token ID takes one, an encoder part takes at least one) exceed"
    )


def test_a_failed_fetch_is_the_requests_error_waited_for_only_after_the_cheaper_rules(
    tiny_fp32: LoadedModel,
) -> None:
    with pytest.raises(Unavailable, match="encoder 10.0.0.1:1 is unavailable"):
        _build(tiny_fp32, _spec(_fetched(Unavailable("encoder 10.0.0.1:1 is unavailable"))))
    never = _fetched(None)  # a fetch that never settles: a rule that fails first never waits for it
    assert _field(tiny_fp32, _spec(never, [10**6])) == "prompt[1].token_ids.ids[0]"
    with pytest.raises(DeadlineExceeded, match=r"prompt\[0\]\.encoder: the deadline passed"):
        _build(tiny_fp32, _spec(never, deadline=time.monotonic() + 0.05))
    never.rows.cancel()
    with pytest.raises(Unavailable, match="cancelled"):
        _build(tiny_fp32, _spec(never))


def test_a_structured_requests_grammar_is_charged_to_its_caller(tiny_fp32: LoadedModel) -> None:
    """The live matchers' memory is bounded per caller (sampling/grammar_memory.py): the compiler must
    be told who asks, or every caller shares one anonymous allowance."""
    asked: list[tuple[StructuredOutput, str]] = []

    class Compiler:
        def constraint(self, spec: StructuredOutput, caller: str = "") -> None:
            asked.append((spec, caller))

    spec = GenerateSpec(
        prompt=[TextPrompt("hi")], structured=StructuredOutput("regex", "a+"), caller="ipv4:10.0.0.7"
    )
    max_token_chars = text_bounds.max_token_chars(tiny_fp32.tokenizer)
    build_request(
        spec,
        "r",
        tiny_fp32.tokenizer,
        tiny_fp32.config,
        512,
        True,
        max_token_chars=max_token_chars,
        grammars=lambda: Compiler(),
    )
    assert asked == [(StructuredOutput("regex", "a+"), "ipv4:10.0.0.7")]


def _check(spec: GenerateSpec, **kwargs) -> None:  # noqa: ANN003
    """The rules the servicer runs before it asks the encoder for anything."""
    check_spec(
        spec,
        vocab_size=10,
        hidden_size=4,
        max_model_len=100,
        enable_prompt_embeds=True,
        has_chat_template=True,
        has_structured=True,
        max_token_chars=4,
        **kwargs,
    )


def _named(name: str) -> GenerateSpec:
    return GenerateSpec([], chat=ChatRequest([ChatMessage("user", [TextPrompt("hi")], name=name)]))


def test_a_messages_name_is_bounded_before_anything_is_rendered() -> None:
    # A 30 MB name was rendered (753 ms on a chat builder thread) and scanned whole; OpenAI's are 64.
    _check(_named("a" * MAX_NAME_CHARS))
    with pytest.raises(InvalidArgument) as info:
        _check(_named("a" * 1_000_000))
    assert info.value.field == "chat.messages[0].name"
    assert info.value.description == f"1000000 characters exceed the limit of {MAX_NAME_CHARS}"


@pytest.mark.parametrize(
    ("key", "special"), [("namespace", ()), ("messages", ()), ("bos_token", ("bos_token",))]
)
def test_a_template_kwarg_named_as_the_templates_own_variable_is_refused_before_any_fetch(
    key: str, special: tuple[str, ...]
) -> None:
    # It was refused at render, after an encoder part's Embed call (e86c9ab: a call refused for its own
    # field costs none).
    chat = ChatRequest([ChatMessage("user", [_fetched(None)])], template_kwargs={key: 1})
    with pytest.raises(InvalidArgument) as info:
        _check(GenerateSpec([], chat=chat), template_variables=special)
    assert info.value.field == f"chat.template_kwargs.{key}"


def test_template_kwargs_past_their_characters_limit_are_refused_before_any_fetch() -> None:
    # Each string is read for special literals at render: 64 MiB of them took 4.4 s on a builder thread.
    chat = ChatRequest([ChatMessage("user", [_fetched(None)])], template_kwargs={"x": "a" * MAX_KWARGS_CHARS})
    with pytest.raises(InvalidArgument) as info:
        _check(GenerateSpec([], chat=chat))
    assert info.value.field == "chat.template_kwargs"
    assert f"limit of {MAX_KWARGS_CHARS}" in info.value.description
