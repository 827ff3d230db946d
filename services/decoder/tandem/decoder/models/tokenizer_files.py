"""A checkpoint directory's tokenizer.json, held to the vocabulary, and the files its chat template comes
from, checked before the server listens."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from tandem.common import vision_language
from tandem.common.wire_limits import MAX_TEMPLATE_CHARS
from tandem.decoder.models.checkpoint_config import read_checkpoint_json
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.model_load_error import ModelLoadError

MAX_TOKENIZER_BYTES = 256 << 20  # the largest in use are about 35 MB (Gemma 3's 262K entries)


def read_tokenizer(model_dir: Path, config: ModelConfig, is_vision_language: bool) -> Tokenizer:
    """tokenizer.json, every token of which has a row of the table of `config.vocab_size` (a
    vision-language checkpoint's text_config's). Raises ModelLoadError naming both files."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"tokenizer.json not found in {model_dir}")
    if (size := path.stat().st_size) > MAX_TOKENIZER_BYTES:  # parsed, it takes more than its size
        raise ModelLoadError(f"{path} has {size:,} bytes, more than the limit of {MAX_TOKENIZER_BYTES:,}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
        raise ModelLoadError(f"tokenizer.json in {model_dir} cannot be read: {e}") from None
    stated = vision_language.stated_vocab_size(model_dir, config.vocab_size, is_vision_language)
    if (num_tokens := tokenizer.get_vocab_size(with_added_tokens=True)) > config.vocab_size:
        raise ModelLoadError(f"{path} has {num_tokens} tokens, more than {stated}")
    # A count within the vocabulary may still hold an id past it (ids need not be dense): a text
    # holding that token would index the embedding table past its end.
    token, token_id = max(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    if token_id >= config.vocab_size:
        raise ModelLoadError(f"{path} maps {token!r} to id {token_id}, past {stated}")
    return tokenizer


def check_chat_template(model_dir: Path) -> None:
    """The files the chat template comes from (engine/admission/chat.py reads them once the weights
    are in) are what it expects, so a broken one is named before the server listens: a malformed
    tokenizer_config.json ended the start-up with json's message naming no file, a chat_template of
    numbers with an AttributeError traceback, a chat_template.jinja not in UTF-8 with the codec's. So
    did a malformed special_tokens_map.json, where the template's special-token names are read from it
    (template_source.read_special_tokens: a config without added_tokens_decoder)."""
    config_path = model_dir / "tokenizer_config.json"
    config = read_checkpoint_json(config_path) if config_path.is_file() else {}
    if "added_tokens_decoder" not in config and (model_dir / "special_tokens_map.json").is_file():
        read_checkpoint_json(model_dir / "special_tokens_map.json")
    template = config.get("chat_template")
    named = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in template
    )
    if template is not None and not isinstance(template, str) and not named:
        raise ModelLoadError(
            f"{config_path}: chat_template must be a string or a list of {{name, template}} objects"
        )
    if (model_dir / "chat_template.json").is_file():
        read_checkpoint_json(model_dir / "chat_template.json")
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        if (size := jinja_path.stat().st_size) > 4 * MAX_TEMPLATE_CHARS:  # UTF-8: 4 bytes a character at most
            raise ModelLoadError(
                f"{jinja_path} has {size:,} bytes, more than {MAX_TEMPLATE_CHARS:,} characters take"
            )
        try:
            text = jinja_path.read_text()
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{jinja_path} is not UTF-8 text: {e}") from None
        if len(text) > MAX_TEMPLATE_CHARS:
            raise ModelLoadError(
                f"{jinja_path} has {len(text):,} characters, more than {MAX_TEMPLATE_CHARS:,}"
            )
