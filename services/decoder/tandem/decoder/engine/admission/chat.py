"""Chat messages -> prompt parts, through the checkpoint's chat template.

Rendering runs in Jinja2's immutable sandbox (no attribute or file escape, no mutation of the
arguments: template_sandbox.py), in a worker process with bounded time, memory and output
(template_worker.py).

How parts keep their boundaries and caller text stays text:
- A token-ID or embedding part is rendered as a unique placeholder (a random nonce per render) and
  spliced back as its own prompt part after rendering, so no tokenization crosses it
  (chat_placeholders.py).
- A text part is rendered inline, so the whole string tokenizes exactly as transformers'
  `apply_chat_template(..., tokenize=True)` does, unless it could take part in a special-token
  literal (such as `<|im_start|>`) in any case (a template may print it `| lower`): one inside it,
  or, at its ends (whitespace aside), the start of one (`... <|im_`) or the end of one
  (`start|> ...`), which a neighbouring part or the template's text could complete. Then it becomes
  a placeholder, spliced back as plain text (`is_plain`), which tokenizes special-token literals as
  the text they spell. A literal spread over several parts has a start in one and an end in
  another, so caller text can never forge a control token, however it is split; the template's own
  control tokens stay.
- A string of template_kwargs that could take part in one is marked instead, and what the template
  printed of it spliced back as plain text (template_kwargs.py). So is every message's name, which
  the template may print changed (`| lower`) or inside pieces of a literal of its own
  (`<|{{ name }}|>`); what it printed is put back inline unless a literal there overlaps it. Markers
  sit at a string's ends only, so where a string at risk was marked, a second render with each such
  string inert must give the template's own text the same special literals, or the chat is refused
  naming it: a template printing a string's middle (`x[34:-35]`) drops both markers. A kwarg
  cannot replace a variable the render sets itself (render_variables.py, and the checkpoint's
  `bos_token`, `eos_token`, ...): a template prints `{{ eos_token }}` as its own text.

Images (a part with `is_image`: an `image` part's rows, or an `encoder` part of a picture, whose rows
its fetch brings): on a vision-language checkpoint every message's content is passed to
the template as a list of `{"type": "text", "text": ...}` and `{"type": "image"}` items, as
transformers' processors pass it (SmolVLM's template reads nothing else), so the checkpoint's own
template decides where each image goes; elsewhere a message holding an image is passed so too. Every
image placeholder (`<image>`) the template writes then takes the next image's rows, in order; the
template must place each image exactly once. Caller text that spells the placeholder stays text, as
any special literal.

The end-of-turn token is read off the template itself: the first special token it writes after an
assistant message's content (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3). A chat's generation
stops there as well as at the model's EOS IDs. It is derived once, at start, by a render given what
the start-up compile check gets (template_source.START_TIME_LIMIT_S), not a request's 1 s: that
render is the template's first compile, on a machine busy loading the model, and a slow moment then
must not decide for good whether chats stop at the end of the assistant's turn. (No render, the
probe's or a request's, counts its worker's start: template_worker.py.) A template that writes no
special token there has none and serves, stopping at the EOS IDs alone, as vLLM and transformers
stop every chat (neither reads a stop token off the template). A probe that fails (the template
raises for it, or a bound is exceeded even so) serves the same way, since either would serve such a
template, but never silently: a warning names the template, why, and what chats then stop at.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers

from tandem.client.errors import FailedPrecondition, InvalidArgument, Unavailable
from tandem.common import vision_language
from tandem.common.torch_part.prompt_parts import EmbeddingPrompt, EncoderPrompt, PromptPart, TextPrompt
from tandem.decoder.engine.admission.chat_placeholders import (
    LocatedPart,
    message_content,
    place_images,
    splice,
)
from tandem.decoder.engine.admission.prefix_space import prefix_free
from tandem.decoder.engine.admission.render_variables import check_template_kwargs
from tandem.decoder.engine.admission.special_literals import literal_tokenizer, trie_pattern
from tandem.decoder.engine.admission.template_kwargs import TemplateKwargs, mark, template_kwargs, unmark
from tandem.decoder.engine.admission.template_source import (
    START_TIME_LIMIT_S,
    read_special_tokens,
    read_template_source,
)
from tandem.decoder.engine.admission.template_worker import (
    TemplateFailed,
    TemplateWorkers,
    TemplateWorkerUnavailable,
)

ROLES = ("system", "user", "assistant", "tool")

# A message's name: a participant's label (OpenAI has documented at most 64 characters of
# [a-zA-Z0-9_-]; its SDK's types and vLLM bound none). Any character passes, as in vLLM; the length is
# bounded before anything is rendered (prompt.check_spec), since a name is not counted in the prompt's
# size: a template may print it many times or none (a 30 MB name rendered in 753 ms on a chat builder
# thread).
MAX_NAME_CHARS = 256

log = logging.getLogger(__name__)


def no_chat_template() -> FailedPrecondition:
    """The refusal of a chat that brings no template to a model that has none: one text for the three
    places that find it (check_spec, build_request without a template, render)."""
    return FailedPrecondition("chat", "this model has no chat template; send `prompt` segments")


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    content: Sequence[PromptPart]  # caller text in it is always plain (`TextPrompt.is_plain` unread)
    name: str | None = None  # the participant's, the template's `name` of the message; None: none


@dataclass(frozen=True)
class ChatRequest:
    """A chat prompt as the engine takes it; protocol.py builds it from tandem.v1.ChatPrompt."""

    messages: Sequence[ChatMessage]
    add_generation_prompt: bool = True  # end with the assistant turn's opening
    template: str | None = None  # a Jinja2 template replacing the model's
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {"enable_thinking": False}


_NAME = re.compile(r"chat\.messages\[\d+\]\.name")  # a message's name, as render() marks it


class ChatTemplate:
    """The checkpoint's template and what it needs: special token names and the end-of-turn ID."""

    def __init__(
        self,
        source: str | None,
        tokenizer: tokenizers.Tokenizer,
        special: dict[str, str],
        workers: TemplateWorkers | None = None,  # None: its own, stopped by close() or with it
        image_placeholder: str | None = None,  # what the template writes for an image; None: no images
        origin: str = "the chat template",  # where `source` was read, as a start-up warning names it
        start_time_limit_s: float = START_TIME_LIMIT_S,  # the end-of-turn probe's render, at start
    ) -> None:
        self.source = source  # None: the checkpoint has no template
        self.origin = origin
        self.tokenizer = tokenizer
        self.special = special  # bos_token / eos_token / ... names the templates refer to
        self.image_placeholder = image_placeholder
        # The same vocabulary with special-token literals split into plain text (for caller text).
        self.literal_tokenizer = literal_tokenizer(tokenizer)
        # Twins of both without SentencePiece's prefix space, for parts that continue a run (None: the
        # tokenizer adds none, as byte-level BPE).
        self.prefix_free = prefix_free(tokenizer, self.literal_tokenizer)
        self.workers = workers or TemplateWorkers()
        self._special_literals = [
            t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content
        ]
        if image_placeholder and image_placeholder not in self._special_literals:
            self._special_literals.append(image_placeholder)
        # Caller text is judged case-blind (casefolded): a template's `| lower` or `| upper` turns
        # `<|IM_START|>` or `[inst]` into a literal. Every literal in one alternation, so a string is
        # read once, not once per literal (267 of them in a Llama 3 vocabulary).
        folded = sorted({literal.casefold() for literal in self._special_literals})
        self._folded_pattern = re.compile(trie_pattern(folded)) if folded else None
        # Every proper start and end of a literal ("<", "<|", ... and ">", "|>", ...), casefolded.
        self._literal_starts = {literal[:n] for literal in folded for n in range(1, len(literal))}
        self._literal_ends = {literal[-n:] for literal in folded for n in range(1, len(literal))}
        # What stands in for a string at risk in _check_nothing_forged: a character in no literal.
        self._inert_char = next(
            (c for c in "xqzjkvw#" if not any(c in literal for literal in folded)), "\ue000"
        )
        self._longest_literal = max(map(len, self._special_literals), default=0)
        # Every literal's start, the longest where several start at one place (it spans the others).
        self._literal_pattern = (
            re.compile(f"(?=({trie_pattern(self._special_literals)}))") if self._special_literals else None
        )
        self._normalizes_specials = tokenizer.normalizer is not None and any(
            t.special and t.normalized for t in tokenizer.get_added_tokens_decoder().values()
        )
        self.end_of_turn_ids = self._find_end_of_turn(start_time_limit_s) if source else ()

    @classmethod
    def load(cls, model_dir: Path, tokenizer: tokenizers.Tokenizer) -> ChatTemplate:
        """The template from the file template_source.py finds it in (None if none has one). A
        vision-language checkpoint's image token (config.json) is the image placeholder."""
        source = read_template_source(model_dir)
        special = read_special_tokens(model_dir)
        model_config = _json_object(model_dir / "config.json")
        image_token_id = vision_language.image_token_id(model_config)
        placeholder = None
        if vision_language.is_vision_language(model_config) and image_token_id is not None:
            placeholder = tokenizer.id_to_token(image_token_id)
        if source is None:
            return cls(None, tokenizer, special, image_placeholder=placeholder)
        return cls(source.text, tokenizer, special, image_placeholder=placeholder, origin=source.origin)

    def render(self, chat: ChatRequest) -> list[LocatedPart]:
        """The prompt parts for `chat`, in order. Raises InvalidArgument / FailedPrecondition."""
        source = chat.template if chat.template is not None else self.source
        if source is None:
            raise no_chat_template()
        check_template_kwargs(chat.template_kwargs, self.special)  # check_spec's too, for a render alone
        nonce = secrets.token_hex(8)  # the parts' placeholders'
        # The markers' own: unmark refuses its nonce outside a pair, where a part's placeholder is.
        kwargs = template_kwargs(chat.template_kwargs, self._could_form_special, secrets.token_hex(8))
        spliced: dict[str, LocatedPart] = {}
        images: list[LocatedPart] = []
        messages = []
        for i, message in enumerate(chat.messages):
            pieces: list[str | None] = []  # None: an image, placed by the template
            for j, part in enumerate(message.content):
                if isinstance(part, EmbeddingPrompt | EncoderPrompt) and part.is_image:
                    path = f"chat.messages[{i}].content[{j}]"
                    if not self.image_placeholder:
                        kind = "encoder" if isinstance(part, EncoderPrompt) else "image"
                        raise FailedPrecondition(f"{path}.{kind}", "this model takes no images")
                    images.append((path, part))
                    pieces.append(None)
                    continue
                if isinstance(part, TextPrompt) and not self._could_form_special(part.text):
                    pieces.append(part.text)
                    continue
                key = f"<<tandem-part-{nonce}-{i}-{j}>>"
                as_given = TextPrompt(part.text, is_plain=True) if isinstance(part, TextPrompt) else part
                spliced[key] = (f"chat.messages[{i}].content[{j}]", as_given)
                pieces.append(key)
            as_items = self.image_placeholder is not None
            rendered: dict[str, Any] = {"role": message.role, "content": message_content(pieces, as_items)}
            messages.append(rendered)
        named = self._with_names(chat, messages, kwargs)
        printed = unmark(
            self._render_text(source, named, chat.add_generation_prompt, kwargs.variables), kwargs
        )
        if kwargs.at_risk:
            self._check_nothing_forged(source, chat, messages, kwargs, printed)
        parts = splice(self._inline_names(printed), spliced, nonce)
        return place_images(parts, images, self.image_placeholder) if images else parts

    def _with_names(
        self,
        chat: ChatRequest,
        messages: list[dict[str, Any]],
        kwargs: TemplateKwargs,
        stand_in: Callable[[str], str] = str,
    ) -> list[dict[str, Any]]:
        """`messages` with their names, each marked (`stand_in` of those at risk): the template prints
        a name where it likes, maybe twice, changed (`| lower`) or between pieces of a literal of its
        own (`<|{{ name }}|>`), so only its printed text, where it stands, tells whether it takes part
        in one (_inline_names)."""
        named = []
        for i, (message, rendered) in enumerate(zip(chat.messages, messages, strict=True)):
            if message.name is not None:
                at_risk = self._could_form_special(message.name)
                text = stand_in(message.name) if at_risk else message.name
                rendered = {**rendered, "name": mark(kwargs, text, f"chat.messages[{i}].name", at_risk)}
            named.append(rendered)
        return named

    def _check_nothing_forged(
        self,
        source: str,
        chat: ChatRequest,
        messages: list[dict[str, Any]],
        kwargs: TemplateKwargs,
        printed: list[LocatedPart],
    ) -> None:
        """Refuses a render whose own text holds other special literals than the same render with
        each string at risk inert. Markers sit at a string's ends only: a template that prints its
        middle (`x[34:-35]`, `x.split('\\n')[1]`, `| striptags` on `[INST]`) drops both, and unmark
        reads what is left as the template's own text. Inert text is as long (truthiness, length and
        slices alike) and of a character in no literal, so it can take part in none."""
        inert = template_kwargs(chat.template_kwargs, self._could_form_special, kwargs.nonce, self._inert)
        named = self._with_names(chat, messages, inert, self._inert)
        again = unmark(self._render_text(source, named, chat.add_generation_prompt, inert.variables), inert)
        if self._own_literals(printed) != self._own_literals(again):
            others = kwargs.at_risk[1:4] + (["..."] if len(kwargs.at_risk) > 4 else [])
            also = f" (or one of {', '.join(others)} was)" if others else ""
            raise InvalidArgument(
                kwargs.at_risk[0],
                "was printed by the template without the markers that keep it plain text (a piece of it: "
                "a slice, a split, a filter's) where a special token then changes with it, so it could not "
                f"be kept plain text{also}",
            )

    def _inert(self, text: str) -> str:
        return self._inert_char * len(text)

    def _own_literals(self, parts: list[LocatedPart]) -> list[str]:
        """The special literals in the template's own text, in order (overlapping ones each)."""
        if self._literal_pattern is None:
            return []
        return [
            found.group(1)
            for path, part in parts
            if path == "chat" and isinstance(part, TextPrompt)
            for found in self._literal_pattern.finditer(part.text)
        ]

    def _render_text(
        self, source: str, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        """Renders in a template worker: bounded in time, memory and output."""
        try:
            return self.workers.render(source, messages, add_generation_prompt, {**self.special, **kwargs})
        except TemplateWorkerUnavailable as e:  # the machine's doing, not the template's: retry
            raise Unavailable(str(e)) from None
        except TemplateFailed as e:
            raise InvalidArgument(e.field, str(e)) from None

    def close(self) -> None:
        """Stops the template workers."""
        self.workers.close()

    def _inline_names(self, parts: list[LocatedPart]) -> list[LocatedPart]:
        """Each name as the template printed it back in the template's text around it, so that it
        tokenizes as transformers' does, unless a special literal there would overlap it: then it
        stays its own plain part. (Under a normalizer that special tokens are matched after, a
        fullwidth `＜` may spell `<`: every name stays plain.)"""
        placed: list[LocatedPart] = []
        run: list[str] = []  # the template's text since the last part kept apart, names inlined
        tail = ""  # the run's last characters, as many as a literal's longest
        for k, (path, part) in enumerate(parts):
            assert isinstance(part, TextPrompt)  # unmark's
            if _NAME.fullmatch(path):
                following = parts[k + 1] if k + 1 < len(parts) else None
                after = (
                    following[1].text[: self._longest_literal] if following and following[0] == "chat" else ""
                )
                apart = self._normalizes_specials or self._overlaps_literal(tail, part.text, after)
            else:
                apart = path != "chat"  # a kwarg's plain text
            if apart:
                placed.extend([("chat", TextPrompt("".join(run)))] if run else [])
                run, tail = [], ""
                placed.append((path, part))
                continue
            run.append(part.text)
            tail = (tail + part.text)[-self._longest_literal :] if self._longest_literal else ""
        placed.extend([("chat", TextPrompt("".join(run)))] if run else [])
        return placed

    def _overlaps_literal(self, before: str, text: str, after: str) -> bool:
        """Whether a special literal in `before + text + after` overlaps `text`."""
        if self._literal_pattern is None:
            return False
        start, end = len(before), len(before) + len(text)
        return any(
            found.start() < end and found.start() + len(found.group(1)) > start
            for found in self._literal_pattern.finditer(before + text + after)
        )

    def _could_form_special(self, text: str) -> bool:
        """Whether `text`, in any case, holds a special-token literal, or could complete one with its
        neighbours."""
        text = text.casefold()
        if self._folded_pattern is not None and self._folded_pattern.search(text):
            return True
        end, start = text.rstrip(), text.lstrip()
        return any(
            end[-n:] in self._literal_starts or start[:n] in self._literal_ends
            for n in range(1, self._longest_literal)
        )

    def _find_end_of_turn(self, time_limit_s: float) -> tuple[int, ...]:
        """The special token the template writes right after an assistant message's content; () if
        it writes none there, or (with a warning) if the probe's render fails."""
        mark = f"tandem{secrets.token_hex(4)}"
        as_items = self.image_placeholder is not None  # as render() passes content
        conversation = [
            {"role": "user", "content": message_content(["x"], as_items)},
            {"role": "assistant", "content": message_content([mark], as_items)},
        ]
        try:
            text = self.workers.render(self.source or "", conversation, True, self.special, time_limit_s)
        except TemplateFailed as error:  # TemplateWorkerUnavailable too
            log.warning(
                "%s: its end-of-turn token could not be derived (rendering a user and an assistant "
                "message: %s); chats stop only at the model's EOS IDs (generation_config.json or "
                "config.json eos_token_id), not at the end of the assistant's turn",
                self.origin, error,
            )  # fmt: skip
            return ()
        if mark not in text:
            return ()
        after = text.split(mark, 1)[1]
        specials = set(self._special_literals)
        for token in self.tokenizer.encode(after, add_special_tokens=False).tokens:
            if token in specials:
                return (self.tokenizer.token_to_id(token),)
        return ()


def _json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}
