"""Qwen2 and Mistral served by `python -m tandem.decoder` over gRPC: transformers' greedy tokens, from
checkpoints transformers wrote; and a sliding window narrower than the context served is one line and
exit 2 before anything listens, naming the window and the flag that makes it fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.tests.ports import free_port
from services.decoder.tests.conftest import _build_checkpoint
from services.decoder.tests.models.helpers import hf_greedy
from tandem.client.client import DecoderClient
from tandem.common.torch_part.random_model import train_tokenizer
from tandem.decoder.api import serving as decoder_serving
from tandem.decoder.api.main import main
from tests.integration.decoder.serving import until_serving

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 1000, 3, 88]
NUM_NEW = 24
WINDOW = 64  # narrower than the variants' 512 positions, wider than PROMPT and NUM_NEW together


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_tokenizer().save(str(path))
    return path


def _checkpoint(variant: str, out_dir: Path, tokenizer_file: Path, **config_changes: object) -> Path:
    """The decoder tests' variant as transformers saved it, its config.json then changed."""
    path = _build_checkpoint(variant, out_dir, tokenizer_file).path
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | config_changes))
    return path


async def _served_greedy(model_dir: Path, *flags: str) -> list[int]:
    """NUM_NEW greedy tokens after PROMPT from a decoder process serving model_dir, which then stops."""
    port = free_port()
    command = [sys.executable, "-m", "tandem.decoder", "--model", str(model_dir), "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--dtype", "float32", "--num-threads", "1", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        async with DecoderClient(f"127.0.0.1:{port}") as client:
            await until_serving(client, process, within_s=60)
            stream = client.generate([PROMPT], max_new_tokens=NUM_NEW, ignore_eos=True, temperature=0.0)
            tokens = [t async for r in stream if r.HasField("delta") for t in r.delta.token_ids]
        process.terminate()
        assert process.wait(timeout=60) == 0
        return tokens
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("variant", "changes", "flags"),
    [
        ("qwen2", {}, ()),  # q/k/v biases, no o_proj bias, tied head
        ("mistral", {}, ()),  # v0.3: sliding_window null
        # v0.1's kind of window, served where it cannot bite: the context held to the window.
        ("mistral", {"sliding_window": WINDOW}, ("--max-model-len", str(WINDOW))),
    ],
    ids=["qwen2", "mistral", "mistral-window-fits"],
)
async def test_the_served_model_gives_transformers_greedy_tokens(
    variant: str, changes: dict, flags: tuple[str, ...], tokenizer_file: Path, tmp_path: Path
) -> None:
    model_dir = _checkpoint(variant, tmp_path / variant, tokenizer_file, **changes)
    # transformers reading the files served (their sliding window included), not the model in memory.
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train(False)
    assert await _served_greedy(model_dir, *flags) == hf_greedy(reference, PROMPT, NUM_NEW)


@pytest.mark.parametrize(
    ("variant", "changes", "flags", "got", "said"),
    [
        (
            "mistral",
            {"sliding_window": WINDOW},
            (),
            "512 (config.json's max_position_embeddings)",
            f"sliding_window {WINDOW}",
        ),
        ("mistral", {"sliding_window": WINDOW}, ("--max-model-len", "65"), "65", f"sliding_window {WINDOW}"),
        (
            "qwen2",
            # As Qwen2.5's files (written before layer_types) state it: max_window_layers says where.
            {
                "use_sliding_window": True,
                "sliding_window": WINDOW,
                "max_window_layers": 1,
                "layer_types": None,
            },
            (),
            "512 (config.json's max_position_embeddings)",
            f"use_sliding_window true, sliding_window {WINDOW} (from layer max_window_layers 1 on, of 2)",
        ),
    ],
    ids=["mistral", "mistral-flag-too-wide", "qwen2"],
)
def test_a_sliding_window_narrower_than_the_context_is_one_line_and_exit_2_before_anything_listens(
    variant: str,
    changes: dict,
    flags: tuple[str, ...],
    got: str,
    said: str,
    tokenizer_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    environ,
) -> None:
    """Served with full attention, a prompt past the window would be answered otherwise than the model
    answers it, and nothing would say so."""
    model_dir = _checkpoint(variant, tmp_path / variant, tokenizer_file, **changes)
    capsys.readouterr()  # transformers' progress bars while it saved
    servers: list[object] = []
    monkeypatch.setattr(decoder_serving, "start_server", lambda *args: servers.append(args))
    assert main(["--model", str(model_dir), "--port", "0", "--dtype", "float32", *flags]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"tandem serve decoder: --max-model-len (TANDEM_MAX_MODEL_LEN) must be at most {WINDOW} to serve "
        f"this checkpoint, got {got}: config.json's {said} narrows what each query attends to, and this "
        "decoder attends to the whole context (sliding-window attention is not implemented)"
    ]
    assert servers == []  # no port was bound
