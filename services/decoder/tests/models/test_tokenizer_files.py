"""tokenizer.json held to the vocabulary, and the chat template's files checked before the server listens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tandem.decoder.models import loader, tokenizer_files
from tandem.decoder.models.loader import ModelLoadError, load_model

from ..conftest import Checkpoint
from .checkpoint_copies import copy_of, edit_json, edit_weights


def test_tokenizer_larger_than_the_vocabulary_is_rejected(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    edit_json(model_dir / "config.json", vocab_size=512)
    edit_weights(
        model_dir, lambda w: w.update({"model.embed_tokens.weight": w["model.embed_tokens.weight"][:512]})
    )
    with pytest.raises(ModelLoadError, match="tokenizer.json has 1024 tokens"):
        load_model(model_dir)


def test_a_tokenizer_file_larger_than_the_limit_is_refused_from_its_size(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 GB tokenizer.json took 1.25 GB to parse before it was found wanting."""
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    size = (model_dir / "tokenizer.json").stat().st_size
    monkeypatch.setattr(tokenizer_files, "MAX_TOKENIZER_BYTES", size - 1)
    with pytest.raises(ModelLoadError, match=rf"tokenizer.json has {size:,} bytes, more than the limit of"):
        loader.check_checkpoint(model_dir)


def test_a_tokenizer_id_past_the_vocabulary_is_refused_though_the_count_fits(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """1,024 entries, one of them id 5000: a text holding it indexed the embedding table past its end."""
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    token = next(t for t, i in vocab.items() if i == 300)
    vocab[token] = 5000
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    said = f"{model_dir / 'tokenizer.json'} maps {token!r} to id 5000, past vocab_size 1024 in "
    with pytest.raises(ModelLoadError, match=re.escape(f"{said}{model_dir / 'config.json'}")):
        loader.check_checkpoint(model_dir)


def test_a_vision_checkpoint_s_tokenizer_is_held_to_text_config_s_vocab_size_naming_both_files(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """The language model's table has text_config's rows; an outer vocab_size (older LLaVA configs carry
    one) sizes nothing. The refusal said 'the model's vocab_size', naming neither file nor text_config."""
    model_dir = copy_of(checkpoints["llama3"], tmp_path)
    text = json.loads((model_dir / "config.json").read_text())  # its tokenizer.json has 1,024 tokens
    llava = {"architectures": ["LlavaForConditionalGeneration"], "vocab_size": 1024}
    text_config = {**text, "model_type": "llama", "vocab_size": 512}
    (model_dir / "config.json").write_text(json.dumps({**llava, "text_config": text_config}))
    said = (
        f"{model_dir / 'tokenizer.json'} has 1024 tokens, more than text_config's vocab_size 512 in "
        f"{model_dir / 'config.json'}"
    )
    with pytest.raises(ModelLoadError, match=re.escape(said)):
        loader.check_checkpoint(model_dir)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        # json's message named no file; the start-up then ended after the server had listened.
        ("tokenizer_config.json", b"{", r"tokenizer_config\.json is not valid JSON"),
        # An AttributeError traceback from the chat template's loader.
        (
            "tokenizer_config.json",
            b'{"chat_template": [1, 2]}',
            r"chat_template must be a string or a list of",
        ),
        ("chat_template.json", b"[]", r"chat_template\.json must hold a JSON object"),
        ("chat_template.jinja", b"\xff\xfe{{ x }}", r"chat_template\.jinja is not UTF-8 text"),
        (
            "chat_template.jinja",
            b"x" * (64 * 1024 + 1),
            r"chat_template\.jinja has 65,537 characters, more than 65,536",
        ),
    ],
)
def test_a_broken_chat_template_file_is_named_before_the_server_listens(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    (model_dir / name).write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        loader.check_checkpoint(model_dir)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"{bos_token: <s>}", r"is not valid JSON"), (b'{"bos_token": "\xff"}', r"is not UTF-8 text")],
)
def test_a_broken_special_tokens_map_is_named_before_the_server_listens_when_it_is_read(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, content: bytes, message: str
) -> None:
    # The template's special-token names come from it when tokenizer_config.json has no
    # added_tokens_decoder (template_source.read_special_tokens); json's message named no file.
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (model_dir / "special_tokens_map.json").write_bytes(content)
    with pytest.raises(ModelLoadError, match=r"special_tokens_map\.json " + message):
        loader.check_checkpoint(model_dir)
    # One with added_tokens_decoder does not read the file, as transformers does not.
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {}}))
    loader.check_checkpoint(model_dir)


def test_a_named_chat_template_list_is_accepted(checkpoints: dict[str, Checkpoint], tmp_path: Path) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    templates = [{"name": "default", "template": "{{ messages }}"}, {"name": "tool_use", "template": "x"}]
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    loader.check_checkpoint(model_dir)
