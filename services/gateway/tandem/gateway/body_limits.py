"""What a request body may hold, checked from counts before anything is parsed or built from it.

NOTE: why the gateway counts at all. The services bound every request (the decoder's
`api/request_width.py`), but only once it reaches them: before that the gateway parses the JSON and
builds a protobuf from it, and both cost time and memory by the element. 7 million `logit_bias`
entries (97 MB) take 13.5 s just to parse; 3 million chat messages, 2.3 s and over a gigabyte of
Python objects. So the gateway bounds each stage before it runs:
- before parsing, the JSON values the raw bytes can hold: every value after a container's first
  is preceded by a comma, and every container opens with `[` or `{`, so their count bounds the
  values (characters inside strings count too: a bound, never an undercount). They are counted as
  the body arrives, so one too wide is refused after its first megabytes. The error names the
  repeated field whose key comes last before the byte where the count passed the bound (the values
  before it filled the budget), else `body`;
- after parsing, before building, the count of each repeated field (`len()` of a list or an object)
  against the services' own limits: messages, content parts, token IDs, inputs, stop strings,
  logit-bias entries, guided choices, images; and the choices (prompts x n) against the gateway's.
The services still check everything; these are only the bounds that must come first.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.client.errors import InvalidArgument

# The decoder's and encoder's own per-request limits (`tandem.decoder.engine.params`,
# `engine/sampling/structured.py`), counted here before the gateway builds anything from a body.
MAX_STOP = 16  # stop strings (OpenAI allows 4; vLLM more)
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids (vLLM's extra)
MAX_TEMPLATE_FIELDS = 256  # chat_template_kwargs fields, nested ones included (the decoder's request_width)
# Fields in `documents` (the body's, or a kwarg of that name), nested ones included, apart from the
# kwargs' 256: a RAG body's 1,000 documents of {title, text} (the decoder's request_width).
MAX_DOCUMENT_FIELDS = 4096
# chat_template_kwargs' nesting, in the decoder's protobuf parser's levels (upb reads 100): the request
# and chat take one, each object three (Struct, map entry, Value), each list two (ListValue, Value).
# Measured: 33 objects parse and 34 do not; an object and 48 lists parse, 49 do not. Counting a list as
# an object refused 37 lists, which parse, as past what the parser reads.
MAX_TEMPLATE_LEVELS = 99
OBJECT_LEVELS = 3
LIST_LEVELS = 2
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_GUIDED_CHOICES = 1024  # guided_choice strings
MAX_INPUTS = 64  # /v1/embeddings inputs: each is an Embed call
# Pictures of one request, a chat's image_url parts or an embeddings body's tandem_image inputs: each is
# an encoder call whose decode holds the encoder's one image thread (about 0.5 s at 32 Mpx), so a
# picture costs far more than a text input and one request may not queue 64 of them (~32 s).
MAX_IMAGES = 16
# Values of a body beyond those its positions account for: top-level fields, a JSON schema, the
# logit_bias map, stop strings, the shape arrays of embedding parts.
VALUES_BESIDE_POSITIONS = 64 * 1024
# Values a completion's position may bring: a chat part is an object of up to 8 (type, text or an
# embeddings object with its dtype, shape [n, h] and data), and text holds a few commas or brackets
# per token at most.
VALUES_PER_POSITION = 16


@dataclass(frozen=True)
class BodyLimits:
    """The bounds of one endpoint's bodies, from the serving model (its info, asked once)."""

    # Positions a prompt may take: the decoder's context for completions and chat; for embeddings,
    # the encoder's max_input_tokens, per input.
    max_positions: int
    # JSON values a body may hold before it is parsed (`check_values`).
    max_values: int
    # The endpoint's repeated fields, which a body too wide is most likely wide in (its error names one).
    wide_fields: tuple[str, ...]
    # Choices of one request (prompts x n, each a Generate stream): the gateway's --max-choices, or
    # its --max-streams-per-caller where that is lower (a request beyond it could never be served).
    # 1 for embeddings, which have no choices.
    max_choices: int = 1

    @classmethod
    def for_chat(cls, max_context_tokens: int, max_choices: int) -> BodyLimits:
        fields = ("messages", "logit_bias", "stop", "guided_choice", "response_format", "tools")
        return cls(max_context_tokens, _completion_values(max_context_tokens), fields, max_choices)

    @classmethod
    def for_completions(cls, max_context_tokens: int, max_choices: int) -> BodyLimits:
        # A batch holds up to max_choices prompts, each of up to a context's positions.
        fields = ("prompt", "logit_bias", "stop", "guided_choice", "response_format")
        values = _completion_values(max_context_tokens * max_choices)
        return cls(max_context_tokens, values, fields, max_choices)

    @classmethod
    def for_embeddings(cls, max_input_tokens: int) -> BodyLimits:
        # Every input may be max_input_tokens token IDs: one comma each (text holds no more per token).
        return cls(max_input_tokens, 2 * MAX_INPUTS * max_input_tokens + VALUES_BESIDE_POSITIONS, ("input",))


def _completion_values(max_positions: int) -> int:
    return VALUES_PER_POSITION * max_positions + VALUES_BESIDE_POSITIONS


COUNTED_BYTES = 1024 * 1024  # counted a slice at a time, so the place where the bound passes is known


def count_values(raw: bytes | bytearray, limits: BodyLimits, start: int = 0, num_counted: int = 0) -> int:
    """`num_counted` (the values of `raw[:start]`) plus those `raw[start:]` may hold; raises
    InvalidArgument as soon as the sum passes `limits`, naming the field the values are most likely
    in. Called on each chunk of a body as it arrives, so a body too wide is refused unread."""
    for begin in range(start, len(raw), COUNTED_BYTES):
        end = min(begin + COUNTED_BYTES, len(raw))
        num_counted += raw.count(b",", begin, end) + raw.count(b"[", begin, end) + raw.count(b"{", begin, end)
        if num_counted > limits.max_values:
            raise InvalidArgument(
                _field_before(raw, end, limits.wide_fields),
                f"the body holds over {limits.max_values} JSON values (commas, brackets and braces, counted "
                f"unparsed) by its byte {end}, more than a context of {limits.max_positions} positions can "
                "use; refused before parsing",
            )
    return num_counted


def _field_before(raw: bytes | bytearray, offset: int, fields: tuple[str, ...]) -> str:
    """The field of `fields` whose key (`"name":`, first occurrence) comes last before `offset`."""
    found = "body", -1
    for name in fields:
        at = raw.find(b'"%s"' % name.encode(), 0, offset)
        if at > found[1]:
            found = name, at
    return found[0]


def at_most(field: str, count: int, limit: int, what: str) -> None:
    """Raises InvalidArgument naming `field` when `count` is over `limit`."""
    if count > limit:
        raise InvalidArgument(field, f"{count} {what} exceed the limit of {limit}")
