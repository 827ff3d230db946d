"""Which file of a checkpoint the chat template comes from, the special-token names it reads, and the
check at start that it compiles.

A checkpoint may hold its template in three places; the first that has one is used, as transformers
reads them: `chat_template.jinja`, a processor's `chat_template.json` (its `chat_template`), and
`tokenizer_config.json`'s `chat_template` (a string, or in the named form the template named
"default"; a GGUF import writes both the .jinja file and this). models/loader.py (through
tokenizer_files.py) has checked each file's shape before the decoder looks here.

The special-token names (`{{ bos_token }}`, `eos_token`, ...) are what transformers' apply_chat_template
passes: each `*_token` key of tokenizer_config.json, a string or, as older checkpoints (Llama 2's,
Mistral's) write it, an AddedToken object (`{"__type": "AddedToken", "content": "<s>", ...}`), whose
`content` is the name. Reading strings alone gave those checkpoints no bos_token: the template printed
nothing where transformers prints `<s>`, and a kwarg named bos_token was printed in its place. A config
without `added_tokens_decoder` (an older transformers saved it) is completed by special_tokens_map.json,
whose names win over the config's, as transformers reads them. transformers 5 writes model-specific tokens
(Gemma 3's `image_token`) in an `extra_special_tokens` dict, which it passes too, ranked over the rest
(read_special_tokens). Of that dict too only `*_token` keys are read, where transformers passes any: no
such name can be one of the variables a render passes itself (`messages`), which would fail every render.

A template with a Jinja syntax error (or a filter or test Jinja does not have, or a block defined
twice: errors Jinja raises while compiling) fails every chat, naming `chat.chat_template` though the
caller sent none. So the decoder compiles the template before it listens and refuses to start over
one that does not compile, naming where it was read, Jinja's message and line. It compiles it in a
template worker, as every render does, and not in this process: Jinja folds constant expressions
while compiling, which runs some of the template (template_worker.py), and the worker bounds that as
it bounds a render. `Environment.parse` alone evaluates nothing and would be safe here, but it finds
only the parser's errors, not an unknown filter, which then failed every chat as before.

A template that compiles but raises for some conversation (`raise_exception`, a missing key) is
served: it fails that request alone, INVALID_ARGUMENT on `chat.chat_template`.

A checkpoint imported from a GGUF file (common/torch_part/gguf_import.py) holds the file's
`tokenizer.chat_template` as its chat_template.jinja, in a cache directory the operator never named;
given the file (`gguf_file`), an error names it and that field instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.decoder.engine.admission.template_worker import (
    TemplateFailed,
    TemplateWorkers,
    TemplateWorkerUnavailable,
)

# What the start check and each render at start (chat.py's end-of-turn probe) get, the worker's start
# included: ten times what a request's render gets (template_worker.TIME_LIMIT_S), because a start-up
# on a busy machine must not be refused, nor its chats changed, for being slow. Compiling a 64 KiB
# template takes about 0.35 s (2 busy cores), a real one's (4-10 KB) 50 ms.
START_TIME_LIMIT_S = 10.0


@dataclass(frozen=True)
class TemplateSource:
    text: str  # the Jinja2 source
    # Where it was read, as a start-up error names it: "<dir>/chat_template.jinja",
    # "<dir>/tokenizer_config.json: chat_template", "<file>.gguf: tokenizer.chat_template".
    origin: str


class TemplateRefused(ValueError):
    """The checkpoint's template cannot serve a chat; the message is one line naming its origin."""


def read_template_source(model_dir: Path, gguf_file: Path | None = None) -> TemplateSource | None:
    """The template the checkpoint in `model_dir` serves chats with; None if it has none.
    `gguf_file`: the GGUF file `model_dir` was imported from, which the origin then names."""
    source = _read_template_source(model_dir)
    if source is None or gguf_file is None:
        return source
    # The import writes that one field to both of the directory's files that can hold a template.
    return TemplateSource(source.text, f"{gguf_file}: tokenizer.chat_template")


def _read_template_source(model_dir: Path) -> TemplateSource | None:
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return TemplateSource(jinja_path.read_text(), str(jinja_path))
    processor_path = model_dir / "chat_template.json"
    processor_template = _json_object(processor_path).get("chat_template")
    if isinstance(processor_template, str):
        return TemplateSource(processor_template, f"{processor_path}: chat_template")
    config_path = model_dir / "tokenizer_config.json"
    template = _json_object(config_path).get("chat_template")
    if isinstance(template, str):
        return TemplateSource(template, f"{config_path}: chat_template")
    if isinstance(template, list):  # the named form: the one named "default" serves chats
        for i, named in enumerate(template):
            if named.get("name") == "default":
                return TemplateSource(named["template"], f"{config_path}: chat_template[{i}] ('default')")
    return None


# The special tokens transformers' tokenizers name themselves (SPECIAL_TOKENS_ATTRIBUTES); any other
# *_token is model-specific (Gemma 3's image_token, boi_token).
_NAMED = {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}


def read_special_tokens(model_dir: Path) -> dict[str, str]:
    """The special-token names a template of the checkpoint in `model_dir` reads, by variable name."""
    config = _json_object(model_dir / "tokenizer_config.json")
    names = _token_names(config)
    # transformers 5 sets the model-specific tokens after the others, so they win whatever file each
    # is in: a config's string under a *_token key it does not name itself (an AddedToken object there
    # is still a dict when it sorts them, so it ranks with the others), then extra_special_tokens'
    # dict (its older name additional_special_tokens' where that is empty), then the map's dict.
    specific = {
        key: name for key, name in names.items() if key not in _NAMED and isinstance(config[key], str)
    }
    specific.update(
        _token_names(_dict(config.get("extra_special_tokens") or config.get("additional_special_tokens")))
    )
    if "added_tokens_decoder" not in config:
        token_map = _json_object(model_dir / "special_tokens_map.json")
        names.update(_token_names(token_map))
        specific.update(_token_names(_dict(token_map.get("extra_special_tokens"))))
    return names | specific


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _token_names(entries: dict[str, Any]) -> dict[str, str]:
    names = {}
    for key, value in entries.items():
        content = value.get("content") if isinstance(value, dict) else value
        if key.endswith("_token") and isinstance(content, str):
            names[key] = content
    return names


def check_template(
    model_dir: Path, time_limit_s: float = START_TIME_LIMIT_S, gguf_file: Path | None = None
) -> None:
    """The checkpoint's template compiles (in a template worker, within its bounds); a checkpoint
    without one passes. `gguf_file`: the GGUF file `model_dir` was imported from. Raises
    TemplateRefused."""
    source = read_template_source(model_dir, gguf_file)
    if source is None:
        return
    workers = TemplateWorkers(workers=1, time_limit_s=time_limit_s)
    try:
        workers.compile(source.text)
    except TemplateWorkerUnavailable as error:  # the machine's fault, not the template's: said so
        raise TemplateRefused(f"{source.origin} could not be checked: {error}") from None
    except TemplateFailed as error:
        raise TemplateRefused(f"{source.origin}: {error}") from None
    finally:
        workers.close()


def _json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}
