"""A chat's parts under SentencePiece's prefix space: the prompt is the text the template renders, with
no space where a part of the caller's text was spliced in (a GGUF file's SentencePiece vocabulary,
imported as Llama 2's and Mistral's are)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from common.tests.common.gguf_files import sentencepiece_fields, small_model, write_gguf
from tandem.common.torch_part.gguf_import import import_gguf
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest, ChatTemplate
from tandem.decoder.engine.admission.prompt import GenerateSpec, TextPrompt, build_request
from tandem.decoder.models.loader import LoadedModel, load_model

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{{ eos_token }}{% endfor %}"
)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    fields = sentencepiece_fields()
    tmp = tmp_path_factory.mktemp("spm")
    path = write_gguf(tmp / "m.gguf", small_model("llama", len(fields.tokens)), fields)
    return load_model(import_gguf(path, tmp / "out", dtype="float32"), dtype="float32")


def _prompt(loaded: LoadedModel, *contents: list[TextPrompt]) -> list[int]:
    template = ChatTemplate(TEMPLATE, loaded.tokenizer, {"bos_token": "<s>", "eos_token": "</s>"})
    chat = ChatRequest([ChatMessage("user", content) for content in contents])
    try:
        spec = GenerateSpec([], chat=chat, cap_max_new_tokens=True)
        return build_request(
            spec, "r", loaded.tokenizer, loaded.config, 512, True, template, max_token_chars=64
        ).prompt_token_ids
    finally:
        template.close()


def _text(loaded: LoadedModel, ids: list[int]) -> str:
    return loaded.tokenizer.decode(ids, skip_special_tokens=False)


def test_text_that_is_not_spliced_is_the_whole_rendered_texts_tokens(spm_model: LoadedModel) -> None:
    ids = _prompt(spm_model, [TextPrompt("hello world")], [TextPrompt("the end")])
    rendered = "<s>[INST] hello world [/INST]</s>[INST] the end [/INST]</s>"
    assert ids == spm_model.tokenizer.encode(rendered, add_special_tokens=False).ids


def test_a_spliced_callers_text_gains_no_space_the_rendered_text_lacks(spm_model: LoadedModel) -> None:
    # The caller's "<s>" is spliced in as plain text: each part alone gained a "▁", so the model read
    # "[INST]  the <s> world  [/INST]".
    ids = _prompt(spm_model, [TextPrompt("the <s> world")], [TextPrompt("hi")])
    # llama.cpp's space before each run after a special token (<s>, </s>) stays.
    assert _text(spm_model, ids) == "<s> [INST] the <s> world [/INST]</s> [INST] hi [/INST]</s>"
    assert ids.count(1) == 1  # the caller's "<s>" is text, not BOS


def test_parts_of_one_message_join_as_one_text(spm_model: LoadedModel) -> None:
    ids = _prompt(spm_model, [TextPrompt("x <"), TextPrompt("s> y"), TextPrompt(" z")])
    assert _text(spm_model, ids) == "<s> [INST] x <s> y z [/INST]</s>"


def test_a_byte_level_tokenizer_has_nothing_to_undo(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    template = ChatTemplate(TEMPLATE, tokenizer, {})
    try:
        assert template.prefix_free is None
    finally:
        template.close()
