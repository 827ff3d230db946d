"""The checkpoint's chat template at start-up: one that does not compile is one line naming where it was
read, Jinja's message and line, and exit 2, before anything listens, wherever the checkpoint keeps it;
one that compiles serves, and if it raises for some conversation, that chat alone fails."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer

from common.tests.common.gguf_files import small_model, write_gguf
from common.tests.ports import free_port
from tandem.client.client import DecoderClient
from tandem.decoder.api import serving as decoder_serving
from tandem.decoder.api.main import main
from tests.integration.decoder.serving import decoder_process, until_serving

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BROKEN = "{% for m in messages %}\n{{ m['content'] ) }}\n{% endfor %}"  # line 2: `)` closes nothing
PREFIX = "tandem serve decoder: --model (TANDEM_MODEL): "


def _with_template(tiny_model_dir: Path, out_dir: Path, place: str, template: str) -> str:
    """A copy of the tiny checkpoint serving `template` from `place`; returns the origin a refusal names."""
    shutil.copytree(tiny_model_dir, out_dir)
    if place in ("chat_template.jinja", "chat_template.json"):
        path = out_dir / place
        path.write_text(template if place.endswith(".jinja") else json.dumps({"chat_template": template}))
        return str(path) if place.endswith(".jinja") else f"{path}: chat_template"
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if place == "tokenizer_config.json":
        config["chat_template"] = template
        origin = f"{config_path}: chat_template"
    else:
        config["chat_template"] = [{"name": "default", "template": template}]
        origin = f"{config_path}: chat_template[0] ('default')"
    config_path.write_text(json.dumps(config))
    return origin


def _must_not_listen(*args: object) -> None:
    raise AssertionError("the decoder listened")


@pytest.mark.parametrize(
    "place",
    ["chat_template.jinja", "chat_template.json", "tokenizer_config.json", "tokenizer_config.json named"],
)
def test_a_template_that_does_not_compile_is_one_line_and_exit_2_before_anything_listens(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    environ,
    place: str,
) -> None:
    """It served, and every chat then failed naming `chat.chat_template`."""
    origin = _with_template(tiny_model_dir, tmp_path / "model", place, BROKEN)
    monkeypatch.setattr(decoder_serving, "start_server", _must_not_listen)
    assert main(["--model", str(tmp_path / "model"), "--port", "0", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert err == f"{PREFIX}{origin}: the template does not compile: line 2: unexpected ')'\n"


def test_a_gguf_files_template_that_does_not_compile_is_named_as_the_files_field(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    environ,
) -> None:
    """It named the chat_template.jinja the import wrote in the model cache, a file the operator never
    named; the template is the GGUF file's tokenizer.chat_template."""
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    model = small_model("qwen3", tokenizer.get_vocab_size())
    gguf_file = write_gguf(tmp_path / "Tiny.Q8_0.gguf", model, tokenizer, chat_template=BROKEN)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the import's model cache
    monkeypatch.setattr(decoder_serving, "start_server", _must_not_listen)
    assert main(["--model", str(gguf_file), "--port", "0", "--dtype", "float32"]) == 2
    refusal = capsys.readouterr().err.splitlines()[-1]  # after the import's progress lines
    said = "tokenizer.chat_template: the template does not compile: line 2: unexpected ')'"
    assert refusal == f"{PREFIX}{gguf_file}: {said}"


async def test_a_template_that_raises_for_one_chat_serves_and_fails_that_chat_alone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    raising = "{% if messages[0]['content'] == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}"
    _with_template(tiny_model_dir, tmp_path / "model", "chat_template.jinja", raising + CHATML)
    port = free_port()
    args = ["--model", str(tmp_path / "model"), "--port", str(port), "--dtype", "float32"]
    with decoder_process(args) as run:
        async with DecoderClient(f"127.0.0.1:{port}") as client:
            await until_serving(client, within_s=60)
            failing = client.chat_text([{"role": "user", "content": "boom"}], max_new_tokens=4)
            neighbour = client.chat_text(
                [{"role": "user", "content": "hi"}], max_new_tokens=4, ignore_eos=True
            )
            error, (_, finished) = await asyncio.gather(failing, neighbour, return_exceptions=True)
            assert isinstance(error, grpc.aio.AioRpcError)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "chat.chat_template" in error.details() and "no boom here" in error.details()
            assert finished.usage.output_tokens == 4
    assert f"serving model on port {port}" in run.output, run.output
