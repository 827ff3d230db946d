"""A piece of prompt (token IDs, text, embedding rows or the encoder's rows for an input) and the rules
every piece obeys.

Prompt segments (`GenerateSpec.prompt`), chat messages (`ChatMessage.content`) and the encoder's
input are made of these pieces, so each rule is written once, here, and every front refuses a bad
piece with the same error. A rule takes the piece's field path as the request spells it
(`prompt[2]`, `chat.messages[0].content[1]`, or "" for the encoder's top-level input) and names the
field and the limit: `prompt[2].embeddings.shape: expected [n >= 1, 576], got [2, 7]`.

Pure Python at run time (torch only for type checking): the sampling params check their token IDs
with `check_token_id` and stay importable without torch.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.client.errors import FailedPrecondition, InvalidArgument
from tandem.common.text_bounds import min_positions, text_rule

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TextPrompt:
    text: str  # tokenized on arrival, without adding BOS/EOS
    # True: special-token literals ("<|im_start|>") stay plain text; False: they are control tokens.
    # Caller text in a chat message is always plain: only the template writes control tokens.
    is_plain: bool = False


@dataclass(frozen=True)
class EmbeddingPrompt:
    rows: torch.Tensor  # [n, hidden_size], any float dtype; request building casts it to the model's
    # An image's rows (a chat message's `image` part): the chat template places them, where it writes
    # the model's image placeholder. Elsewhere they are rows like any other.
    is_image: bool = False


ENCODER_INPUTS = ("text", "token_ids", "image")


@dataclass(frozen=True)
class EncoderPrompt:
    """The encoder's rows for an input, which the decoder fetches itself while the request is built
    (tandem.decoder.api.encoder_parts): the caller sends the input, never the rows."""

    kind: str  # one of ENCODER_INPUTS: what the encoder embeds
    content: str | Sequence[int] | bytes  # the input as sent: text, token IDs, or a picture's bytes
    # Settles with the rows, [n, hidden_size] in any float dtype, or with the error that failed the
    # fetch; None on a decoder without an encoder (the part is refused).
    rows: concurrent.futures.Future[torch.Tensor] | None = None
    # Its rows are one per position of its input as the decoder's tokenizer reads it: the decoder asks
    # for them unpooled (POOLING_NONE) of an embedder that tokenizes with the decoder's own tokenizer
    # (GetModelInfo.embedder lookup or soft-prompt), so the prompt bound counts it as its input. False:
    # how many rows come is unknown until they do (an embedder of its own tokenizer, a projector's
    # WordPiece, or one not yet asked), and it counts at one.
    counts_as_input: bool = False

    @property
    def is_image(self) -> bool:
        """A picture's rows: the chat template places them, as an `image` part's."""
        return self.kind == "image"


# A sequence of ints is token IDs: a list, or the proto's repeated field as it is (copying 16M IDs
# into a list costs seconds and gigabytes before the length rule could refuse them).
PromptPart = Sequence[int] | TextPrompt | EmbeddingPrompt | EncoderPrompt


def field_of(path: str, name: str) -> str:
    """`name` inside the piece at `path`: `prompt[2]` + `text` -> `prompt[2].text`; "" + `text` -> `text`."""
    return f"{path}.{name}" if path else name


def check_part(part: PromptPart, path: str, hidden_size: int, accepts_embeddings: bool) -> None:
    """The rules of one piece that cost nothing per position: not empty; embeddings accepted here
    (FailedPrecondition otherwise) and shaped [n >= 1, hidden_size]; an encoder part only where there
    is an encoder to fetch its rows (its rows' shape is checked once they come: `check_rows`)."""
    if isinstance(part, TextPrompt):
        if not part.text:
            raise InvalidArgument(field_of(path, "text"), "must not be empty")
    elif isinstance(part, EmbeddingPrompt):
        field = field_of(path, "image" if part.is_image else "embeddings")
        if not accepts_embeddings:
            raise FailedPrecondition(field, "prompt embeddings are disabled on this server")
        shape = list(part.rows.shape)
        if len(shape) != 2 or shape[1] != hidden_size or shape[0] < 1:
            raise InvalidArgument(f"{field}.shape", f"expected [n >= 1, {hidden_size}], got {shape}")
    elif isinstance(part, EncoderPrompt):
        field = field_of(path, "encoder")
        if part.rows is None:
            raise FailedPrecondition(field, "this decoder has no encoder; start it with --encoder ADDR")
        if not accepts_embeddings:
            raise FailedPrecondition(field, "prompt embeddings are disabled on this server")
        if not part.content:
            raise InvalidArgument(
                f"{field}.{part.kind}{'.ids' if part.kind == 'token_ids' else ''}", "must not be empty"
            )
    elif not part:
        raise InvalidArgument(field_of(path, "token_ids.ids"), "must not be empty")


def check_rows(rows: torch.Tensor, field: str, hidden_size: int) -> None:
    """An encoder part's rows, once fetched: [n >= 1, hidden_size], as an embeddings part's."""
    shape = list(rows.shape)
    if len(shape) != 2 or shape[1] != hidden_size or shape[0] < 1:
        raise InvalidArgument(
            field,
            f"the encoder's rows are {shape}, this model takes [n >= 1, {hidden_size}]: "
            "serve the encoder with this decoder's model",
        )


def num_positions_at_least(parts: Sequence[PromptPart], max_token_chars: int) -> int:
    """Fewest positions `parts` can take, from sizes alone: IDs and rows counted, text at one position
    per `max_token_chars` characters (tandem.common.text_bounds), an encoder part as its input where
    its rows are known to be one per position of it (`EncoderPrompt.counts_as_input`; a picture at
    one), else at one. Reads no ID, row or character.

    An encoder part's text counts by the same bound then: the encoder serves the decoder's model (its
    replies are checked for it, `encoder_model_check`) with the decoder's tokenizer. Counted at one, a
    text that could never fit the decoder's context was embedded anyway, and refused naming the
    encoder's max_input_tokens rather than the decoder's context; counted as its input where the
    encoder pools its rows, or tokenizes with a vocabulary of its own, a part whose rows fit was
    refused."""
    return sum(_counted(part, max_token_chars)[0] for part in parts)


def how_counted(parts: Sequence[PromptPart], max_token_chars: int) -> str:
    """How `num_positions_at_least` counted `parts`, in a refusal's words: each rule that applied."""
    used = {_counted(part, max_token_chars)[1] for part in parts}
    rules = {"text": text_rule(max_token_chars), **_RULES}
    return ", ".join(words for rule, words in rules.items() if rule in used)


# How a part's positions are counted, by rule, in a refusal's words (text's: `text_rule`).
_RULES = {
    "id": "a token ID takes one",
    "row": "a row takes one",
    "one": "an encoder part takes at least one",
}


def _counted(part: PromptPart, max_token_chars: int) -> tuple[int, str]:
    """The fewest positions `part` takes, and the rule that counted them ("text" or a key of _RULES)."""
    if isinstance(part, TextPrompt):
        return min_positions(part.text, max_token_chars), "text"
    if isinstance(part, EmbeddingPrompt):
        return part.rows.shape[0], "row"
    if isinstance(part, EncoderPrompt):
        if not part.counts_as_input or part.is_image:
            return 1, "one"
        if isinstance(part.content, str):
            return min_positions(part.content, max_token_chars), "text"
        return len(part.content), "id"
    return len(part), "id"


def check_token_ids(ids: Sequence[int], field: str, vocab_size: int) -> None:
    """Every ID in [0, vocab_size); the error names the first bad one, `field[j]`."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # two C-speed passes; the loop only on failure
        j = next(j for j, token_id in enumerate(ids) if not 0 <= token_id < vocab_size)
        check_token_id(ids[j], f"{field}[{j}]", vocab_size)


def check_token_id(token_id: int, field: str, vocab_size: int) -> None:
    if not 0 <= token_id < vocab_size:
        raise InvalidArgument(field, f"token id {token_id} outside [0, {vocab_size})")
