"""Where a checkpoint's chat template comes from, and the start-up check: a template that does not compile
is refused naming its file and field, Jinja's message and line; one that compiles but raises for some
conversation passes (it fails that request alone); compiling is bounded in the template's worker. The
special-token names a template reads come from the files transformers reads them from."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer

from tandem.client.errors import InvalidArgument
from tandem.common.torch_part.prompt_parts import TextPrompt
from tandem.decoder.engine.admission import template_source
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest, ChatTemplate
from tandem.decoder.engine.admission.template_source import (
    TemplateRefused,
    TemplateSource,
    check_template,
    read_special_tokens,
    read_template_source,
)

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# A syntax error on line 2: the `)` closes nothing.
BROKEN = "{% for m in messages %}\n{{ m['content'] ) }}\n{% endfor %}"


def _write(model_dir: Path, place: str, template: str) -> str:
    """Writes `template` where `place` says; returns the origin a refusal names."""
    if place == "chat_template.jinja":
        (model_dir / place).write_text(template)
        return str(model_dir / place)
    if place == "chat_template.json":
        (model_dir / place).write_text(json.dumps({"chat_template": template}))
        return f"{model_dir / place}: chat_template"
    config = model_dir / "tokenizer_config.json"
    if place == "tokenizer_config.json":
        config.write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
        return f"{config}: chat_template"
    assert place == "tokenizer_config.json, named"
    named = [{"name": "tool_use", "template": CHATML}, {"name": "default", "template": template}]
    config.write_text(json.dumps({"chat_template": named}))
    return f"{config}: chat_template[1] ('default')"


PLACES = [
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer_config.json",
    "tokenizer_config.json, named",
]


@pytest.mark.parametrize("place", PLACES)
def test_a_template_is_read_with_where_it_came_from(tmp_path: Path, place: str) -> None:
    origin = _write(tmp_path, place, CHATML)
    assert read_template_source(tmp_path) == TemplateSource(CHATML, origin)


def test_the_first_file_that_has_a_template_is_the_one_served(tmp_path: Path) -> None:
    _write(tmp_path, "tokenizer_config.json", "from the tokenizer config")
    assert read_template_source(tmp_path).text == "from the tokenizer config"
    _write(tmp_path, "chat_template.json", "from the processor")
    assert read_template_source(tmp_path).text == "from the processor"
    _write(tmp_path, "chat_template.jinja", "from the .jinja file")
    assert read_template_source(tmp_path).text == "from the .jinja file"


def test_a_checkpoint_without_a_template_has_none_and_passes(tmp_path: Path) -> None:
    assert read_template_source(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "x", "template": ""}]})
    )
    assert read_template_source(tmp_path) is None  # the named form without a "default"
    check_template(tmp_path)


@pytest.mark.parametrize("place", PLACES)
def test_a_syntax_error_is_refused_naming_the_place_jinjas_message_and_line(
    tmp_path: Path, place: str
) -> None:
    origin = _write(tmp_path, place, BROKEN)
    with pytest.raises(TemplateRefused) as refused:
        check_template(tmp_path)
    assert str(refused.value) == f"{origin}: the template does not compile: line 2: unexpected ')'"


@pytest.mark.parametrize(
    ("template", "said"),
    [
        ("a\nb\n{{ messages | no_such_filter }}", "line 3: No filter named 'no_such_filter'."),
        ("{{ messages is no_such_test }}", "line 1: No test named 'no_such_test'."),
        ("{% for m in messages %}", "line 1: Unexpected end of template."),
    ],
)
def test_what_jinja_finds_only_while_compiling_is_refused_too(
    tmp_path: Path, template: str, said: str
) -> None:
    # An unknown filter or test parses; Jinja raises it when it compiles the template, which every
    # render does first, so it failed every chat as a syntax error did.
    _write(tmp_path, "chat_template.jinja", template)
    with pytest.raises(TemplateRefused, match=f"does not compile: {said}"):
        check_template(tmp_path)


@pytest.mark.parametrize(
    "template",
    [
        "{% if messages[0]['content'] == 'boom' %}{{ raise_exception('boom') }}{% endif %}" + CHATML,
        "{{ messages[5]['content'] | trim }}",  # fails for a conversation shorter than six messages
    ],
)
def test_a_template_that_compiles_but_raises_for_some_chats_passes(tmp_path: Path, template: str) -> None:
    _write(tmp_path, "tokenizer_config.json", template)
    check_template(tmp_path)


def test_a_broken_template_in_a_file_that_is_not_served_passes(tmp_path: Path) -> None:
    _write(tmp_path, "tokenizer_config.json", BROKEN)
    _write(tmp_path, "chat_template.jinja", CHATML)
    check_template(tmp_path)


def test_compiling_is_bounded_by_the_worker_not_run_in_this_process(tmp_path: Path) -> None:
    # Jinja folds constants while compiling: 10 ** (10 ** 7) took 9 s of this process, and this is
    # ten times the exponent. (Jinja's ** is left-associative: 10 ** 10 ** 8 is (10 ** 10) ** 8.)
    _write(tmp_path, "chat_template.jinja", "{{ 10 ** (10 ** 8) }}")
    # The two promises, each on what no other process stretches: the refusal says the worker ran into
    # its limit (it is killed at 1 s of the wall clock), and this process's CPU time, every thread's,
    # shows it did not compile the template itself (only started the worker and waited). A wall-clock
    # bound here also timed the worker's start, which two test workers on two cores stretch.
    cpu_start = time.process_time()
    with pytest.raises(TemplateRefused, match=r"chat_template\.jinja: the template ran longer than 1 s"):
        check_template(tmp_path, time_limit_s=1.0)
    assert time.process_time() - cpu_start < 0.5


def test_the_default_models_template_is_its_imported_jinja_file_and_passes(smollm2_dir: Path) -> None:
    source = read_template_source(smollm2_dir)
    assert source is not None and source.origin == str(smollm2_dir / "chat_template.jinja")
    check_template(smollm2_dir)


@pytest.mark.parametrize("place", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_template_imported_from_a_gguf_file_is_named_as_that_files_field(
    tmp_path: Path, place: str
) -> None:
    # The import writes the file's tokenizer.chat_template to both; the operator named the file, and
    # a refusal named the import's copy in ~/.cache/tandem/models instead.
    _write(tmp_path, place, BROKEN)
    gguf_file = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    origin = f"{gguf_file}: tokenizer.chat_template"
    assert read_template_source(tmp_path, gguf_file) == TemplateSource(BROKEN, origin)
    with pytest.raises(TemplateRefused) as refused:
        check_template(tmp_path, gguf_file=gguf_file)
    assert str(refused.value) == f"{origin}: the template does not compile: line 2: unexpected ')'"
    (tmp_path / "no-template").mkdir()  # a GGUF file without tokenizer.chat_template
    assert read_template_source(tmp_path / "no-template", gguf_file) is None


def test_a_worker_that_never_starts_is_said_to_be_the_machines_fault_not_the_templates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    origin = _write(tmp_path, "chat_template.jinja", CHATML)

    def never_ready(memory_bytes: int) -> subprocess.Popen[bytes]:
        sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
        return subprocess.Popen(sleep, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    slow = functools.partial(template_source.TemplateWorkers, start_limit_s=0.3, spawn=never_ready)
    monkeypatch.setattr(template_source, "TemplateWorkers", slow)
    with pytest.raises(TemplateRefused) as refused:
        check_template(tmp_path)
    assert (
        str(refused.value)
        == f"{origin} could not be checked: the template worker did not start within 0.3 s (a busy machine)"
    )


def _added_token(content: str) -> dict[str, object]:
    """A special token as older checkpoints' tokenizer_config.json writes it (Llama 2's, Mistral's)."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False}


def test_special_tokens_are_read_as_strings_or_added_token_objects(tmp_path: Path) -> None:
    # The objects were dropped: {{ bos_token }} printed nothing where transformers prints <s> (review 7, F9).
    config = {"bos_token": _added_token("<s>"), "eos_token": "</s>", "pad_token": None, "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_special_tokens(tmp_path) == {"bos_token": "<s>", "eos_token": "</s>"}


def test_special_tokens_map_json_completes_a_config_as_transformers_reads_it(tmp_path: Path) -> None:
    # A config without added_tokens_decoder (an older transformers saved it) takes special_tokens_map.json's
    # names over its own; one with it ignores that file.
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": _added_token("<s>"), "unk_token": "<unk>"})
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<b>", "eos_token": "</s>"}))
    assert read_special_tokens(tmp_path) == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config = {"bos_token": "<b>", "eos_token": "</s>", "added_tokens_decoder": {}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_special_tokens(tmp_path) == {"bos_token": "<b>", "eos_token": "</s>"}


def _save_tokenizer(model_dir: Path, specials: tuple[str, ...] = ()) -> Tokenizer:
    """A tokenizer.json of a word or two, beside which AutoTokenizer loads a tokenizer_config.json."""
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return tokenizer


# transformers 5 ranks a model-specific token (tokenizer_config.json's or special_tokens_map.json's
# extra_special_tokens dict, or a *_token key of the config that is not one of the seven it names and
# holds a string) over any other *_token key, whichever file each is in; the map's dict over the config's.
DECODER = {"added_tokens_decoder": {}}  # the map is read without it alone


@pytest.mark.parametrize(
    ("config", "token_map"),
    [
        ({**DECODER, "extra_special_tokens": {"image_token": "<i>"}}, None),
        ({**DECODER, "extra_special_tokens": {"image_token": _added_token("<i>")}}, None),
        ({**DECODER, "image_token": "<a>", "extra_special_tokens": {"image_token": "<b>"}}, None),
        ({**DECODER, "bos_token": "<s>", "extra_special_tokens": {"bos_token": "<x>"}}, None),
        ({**DECODER, "additional_special_tokens": {"image_token": "<i>"}}, None),  # its older name
        ({**DECODER, "extra_special_tokens": ["<i>"]}, None),  # a list names nothing
        ({**DECODER}, {"extra_special_tokens": {"image_token": "<m>"}}),
        ({"extra_special_tokens": {"image_token": "<c>"}}, {"extra_special_tokens": {"image_token": "<m>"}}),
        ({"image_token": "<c>"}, {"image_token": "<m>"}),
        ({"image_token": _added_token("<c>")}, {"image_token": "<m>"}),
        ({"image_token": "<c>"}, {"extra_special_tokens": {"image_token": "<m>"}}),
        ({"extra_special_tokens": {"image_token": "<c>"}}, {"image_token": "<m>"}),
        ({"extra_special_tokens": {"bos_token": "<c>"}}, {"bos_token": "<m>"}),
    ],
)
def test_model_specific_special_tokens_are_read_as_transformers_ranks_them(
    tmp_path: Path, config: dict[str, object], token_map: dict[str, object] | None
) -> None:
    # transformers passed extra_special_tokens' image_token to the template; here it was undefined and
    # a kwarg could take its name (review 9, G2).
    _save_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config})
    )
    if token_map is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(token_map))
    reference = AutoTokenizer.from_pretrained(str(tmp_path)).special_tokens_map
    assert read_special_tokens(tmp_path) == reference


def test_a_template_prints_added_token_objects_as_transformers_does(tmp_path: Path) -> None:
    tokenizer = _save_tokenizer(tmp_path, ("<s>", "</s>"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _added_token("<s>"),
        "eos_token": _added_token("</s>"),
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reference = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )
    template = ChatTemplate.load(tmp_path, tokenizer)
    try:
        chat = ChatRequest([ChatMessage("user", [TextPrompt("hi")])], add_generation_prompt=False)
        assert "".join(part.text for _, part in template.render(chat)) == reference == "<s>hi</s>"
        with pytest.raises(InvalidArgument) as error:  # it was accepted and printed in the token's place
            template.render(ChatRequest(chat.messages, template_kwargs={"bos_token": "x"}))
        assert error.value.field == "chat.template_kwargs.bos_token"
    finally:
        template.close()
