"""`python -m tandem.encoder` stopping: within --grace-s (plus the worker's step in hand), whatever
its batches hold, every caller answered and nothing logged as an error; and at once while the embedder
still loads. Starting: what the embedder's load would refuse of --model, --adapter, --encoder-model or
--projector is refused before the port opens, in one line naming the flag (exit 2)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from common.tests.ports import free_port
from common.tests.signalled_process import signal_after_line
from common.tests.sparse_checkpoint import write_sparse_table
from services.encoder.tests.helpers import write_prompt_adapter, write_random_projector
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc
from tandem.common.running_server import DRAIN_NOTICE_S
from tandem.encoder import __main__ as encoder_main
from tandem.encoder.__main__ import CUT_S, drain
from tandem.encoder.config import EncoderConfig
from tandem.encoder.projector import LLAVA_PREFIX

GRACE_S = 1.0
NUM_CALLS = 32
# Past the grace period: the worker's step in hand (one of the images below: ~0.5 s on 2 idle cores)
# and the interpreter's exit (~1 s with torch loaded): 1.0-2.5 s measured, with room here for a loaded
# machine. The process used to run its batches to their end first: it exited 16.3 s after the signal
# with these 32 images (43 s in the adversarial pass's larger case).
MAX_EXIT_AFTER_GRACE_S = 6.0


def _thin_png() -> bytes:
    """480 x 65,000 pixels of one colour: 220 KB that take ~0.5 s to decode and resize."""
    out = io.BytesIO()
    Image.new("RGB", (480, 65_000), (30, 60, 90)).save(out, "PNG")
    return out.getvalue()


async def _wait_serving(channel: grpc.aio.Channel, process: subprocess.Popen) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the encoder exited early with {process.returncode}"
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Encoder"), timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass  # not listening yet
        await asyncio.sleep(0.1)
    raise AssertionError("the encoder was not SERVING within 60 s")


async def test_sigterm_during_a_long_image_batch_ends_every_call_and_the_process_within_the_grace_period(
    tiny_llava: Path,
) -> None:
    port = free_port()
    command = [
        *(sys.executable, "-m", "tandem.encoder", "--model", str(tiny_llava), "--dtype", "float32"),
        *("--port", str(port), "--grace-s", str(GRACE_S)),
        # All of them queued at once; each image declares ~0.94 s of decoding, over the servicer's
        # MAX_BATCH_DECODE_S, so they run one to a batch, and those done before the cut are answered.
        *("--max-batch-size", str(NUM_CALLS), "--max-batch-wait-ms", "500"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_ENCODER_")}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await _wait_serving(channel, process)
            stub = encoder_pb2_grpc.EncoderStub(channel)
            request = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=_thin_png()))

            async def call() -> tuple[grpc.StatusCode, str, float]:
                try:
                    await stub.Embed(request, timeout=60)
                    return grpc.StatusCode.OK, "", time.monotonic()
                except grpc.aio.AioRpcError as error:
                    return error.code(), error.details() or "", time.monotonic()

            calls = [asyncio.ensure_future(call()) for _ in range(NUM_CALLS)]
            await asyncio.sleep(1.5)  # the 500 ms wait for company is over: the images decode, one a batch
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            outcomes = await asyncio.gather(*calls)
        output, _ = await asyncio.to_thread(process.communicate, timeout=60)
        exited_after_s = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    log = output.decode(errors="replace")
    assert exited_after_s < GRACE_S + MAX_EXIT_AFTER_GRACE_S, (exited_after_s, log)
    assert process.returncode == 0, log
    for code, details, ended in outcomes:
        assert ended - signalled < GRACE_S + 2.0
        assert code is grpc.StatusCode.OK or (
            code is grpc.StatusCode.UNAVAILABLE and "the encoder is shutting down" in details
        ), (code, details)
    num_unavailable = sum(code is grpc.StatusCode.UNAVAILABLE for code, _, _ in outcomes)
    assert num_unavailable > 0  # the calls outlasted the grace
    # The log counts every call the cut ended: each one not answered by then, none answered twice.
    assert f"grace period over: {num_unavailable} calls in flight end UNAVAILABLE" in log, log
    assert " ERROR " not in log and "Traceback" not in log, log


# A signal while the embedder loads: the process used to wait for the load to end (the worker thread
# cannot be interrupted, and the interpreter's exit joins it). Now it exits within this, with no
# calls to wait for: 0.03-0.06 s measured on 2 busy cores, where it exited 7.8-9.3 s after the signal.
MAX_EXIT_WHILE_LOADING_S = 2.0


def _slow_checkpoint(tiny_model: Path, out_dir: Path) -> Path:
    """The tiny model's tokenizer over a float32 token table of 128 Mi elements (512 MiB), written as
    a sparse file: made at once, it takes seconds to load under --quantization int8 (read, cast to
    bfloat16, rounded per row) on one thread."""
    vocab_size, hidden_size = 65536, 2048
    out_dir.mkdir()
    shutil.copy(tiny_model / "tokenizer.json", out_dir / "tokenizer.json")
    config = json.loads((tiny_model / "config.json").read_text())
    config.update(vocab_size=vocab_size, hidden_size=hidden_size)
    (out_dir / "config.json").write_text(json.dumps(config))
    table_shape = (vocab_size, hidden_size)
    write_sparse_table(
        out_dir / "model.safetensors", {}, "model.embed_tokens.weight", table_shape, torch.float32
    )
    return out_dir


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_embedder_loads_ends_the_process_at_once(
    tiny_model: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    model_dir = _slow_checkpoint(tiny_model, tmp_path / "slow")
    command = [
        *(sys.executable, "-m", "tandem.encoder", "--model", str(model_dir), "--quantization", "int8"),
        *("--port", str(free_port()), "--grace-s", "30"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_ENCODER_")}
    env["OMP_NUM_THREADS"] = "1"
    exited = signal_after_line(command, sig, "loading the lookup embedder", env)
    log = exited.log
    assert exited.after_s < MAX_EXIT_WHILE_LOADING_S, (exited.after_s, log)
    assert exited.status == 0, log
    assert "stopping before the embedder finished loading" in log, log
    assert log.rstrip().endswith("stopped"), log
    assert " ERROR " not in log and "Traceback" not in log, log


class _StoppingServer:
    def __init__(self) -> None:
        self.stops: list[tuple[float | None, float | None]] = []

    async def stop(self, grace_s: float | None, notice_s: float | None = None) -> None:
        self.stops.append((grace_s, notice_s))


class _Servicer:
    def end_calls(self) -> int:
        return 0


@pytest.mark.parametrize("grace_s", [0.0, 0.1, 30.0])
async def test_the_drain_notice_falls_within_the_grace_not_its_cut(grace_s: float) -> None:
    """Calls taken after the grace are refused by end_calls (UNAVAILABLE): the server's drain notice,
    while it still takes calls, must end by then, and a grace of 0 has none (it was 0.25 s at grace
    0: 11 calls taken after the grace)."""
    server = _StoppingServer()
    await drain(server, _Servicer(), grace_s)  # type: ignore[arg-type]
    assert server.stops == [(grace_s + CUT_S, min(grace_s, DRAIN_NOTICE_S))]


@pytest.mark.parametrize("embedder", ["lookup", "soft-prompt"])
@pytest.mark.parametrize("damage", ["broken", "missing"])
def test_a_tokenizer_json_missing_or_broken_is_refused_before_listening_naming_it(
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    environ,
    embedder: str,
    damage: str,
) -> None:
    """Found only by the load, after 'listening on' (exit 1)."""
    broken = Path(shutil.copytree(tiny_model, tmp_path / "broken"))
    path = broken / "tokenizer.json"
    if damage == "missing":
        path.unlink()
    else:
        path.write_text('{"broken')
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    servers: list[object] = []
    monkeypatch.setattr(encoder_main, "start_server", lambda *args: servers.append(args))
    argv = ["--model", str(broken), "--port", "0", "--embedder", embedder]
    assert encoder_main.main(argv + (["--adapter", str(adapter)] if embedder == "soft-prompt" else [])) == 2
    said = (
        f"tokenizer.json not found in {broken}"
        if damage == "missing"
        else f"{path}: not a tokenizer the tokenizers library reads: "
    )
    err = capsys.readouterr().err
    assert err.startswith(f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): {said}"), err
    assert err.count("\n") == 1
    assert servers == []  # no port was bound


def _with_tokens_past_the_table(tiny_model: Path, out_dir: Path) -> tuple[Path, int, int]:
    """A copy of `tiny_model` whose tokenizer.json adds tokens past config.json's vocab_size (a
    vision-language checkpoint's text_config's)."""
    model = Path(shutil.copytree(tiny_model, out_dir))
    hf_config = json.loads((model / "config.json").read_text())
    vocab_size = hf_config.get("text_config", hf_config)["vocab_size"]
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    ids = [*tokenizer["model"]["vocab"].values(), *(added["id"] for added in tokenizer["added_tokens"])]
    for token_id in range(max(ids) + 1, vocab_size + 5):
        tokenizer["added_tokens"].append(
            {
                "id": token_id,
                "content": f"<extra_{token_id}>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model, vocab_size + 5, vocab_size


def test_a_tokenizer_with_more_tokens_than_the_table_is_refused_before_listening_naming_model(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found only by the load, after 'listening on' (exit 1)."""
    model, num_tokens, vocab_size = _with_tokens_past_the_table(tiny_model, tmp_path / "bigtok")
    assert _refusal_before_listening(model, monkeypatch, capsys) == (
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): {model / 'tokenizer.json'} has "
        f"{num_tokens} tokens, more than vocab_size {vocab_size} in {model / 'config.json'}\n"
    )


def _refusal_before_listening(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *flags: str
) -> str:
    """What `python -m tandem.encoder --model MODEL FLAGS` says as it exits 2 with no port bound."""
    servers: list[object] = []
    monkeypatch.setattr(encoder_main, "start_server", lambda *args: servers.append(args))
    assert encoder_main.main(["--model", str(model), "--port", "0", *flags]) == 2
    assert servers == []
    return capsys.readouterr().err


def test_a_vision_checkpoint_s_tokenizer_is_held_to_text_config_s_vocab_size_before_listening(
    tiny_llava: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its language model's table has text_config's rows; no start-up check or load compared the
    tokenizer with them, and an outer vocab_size (older LLaVA configs carry one) sizes nothing."""
    model, num_tokens, vocab_size = _with_tokens_past_the_table(tiny_llava, tmp_path / "bigtok")
    hf_config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf_config, "vocab_size": num_tokens + 100}))
    assert _refusal_before_listening(model, monkeypatch, capsys) == (
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): {model / 'tokenizer.json'} has "
        f"{num_tokens} tokens, more than text_config's vocab_size {vocab_size} in {model / 'config.json'}\n"
    )


def test_the_tokenizer_parsed_before_listening_is_the_one_the_load_takes(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tokenizer.json was parsed twice at start: 65-290 ms each for SmolLM2's 3.5 MB."""
    served: list[object] = []

    async def serve(config: object, tokenizer: object = None) -> bool:
        served.append(tokenizer)
        return True

    monkeypatch.setattr(encoder_main, "serve", serve)
    assert encoder_main.main(["--model", str(tiny_model), "--port", "0"]) == 0
    assert [type(tokenizer).__name__ for tokenizer in served] == ["Tokenizer"]


def test_a_vision_checkpoint_whose_image_token_is_not_in_its_tokenizer_is_refused_before_listening(
    tiny_llava: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found only by the load, after 'listening on' (exit 1)."""
    model = tmp_path / "llava"
    model.mkdir()
    for path in tiny_llava.iterdir():
        if path.name != "config.json":
            (model / path.name).symlink_to(path)
    hf_config = json.loads((tiny_llava / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf_config, "image_token_index": 10**6}))
    assert _refusal_before_listening(model, monkeypatch, capsys) == (
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): config.json in {model}: "
        "image_token_index is not a token of tokenizer.json\n"
    )


def test_a_config_json_that_cannot_be_read_is_refused_before_listening_naming_model(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """EACCES (simulated: root reads any file) was a PermissionError traceback at start, exit 1."""
    real_read_bytes = Path.read_bytes

    def read_bytes(path: Path) -> bytes:
        if path == tiny_model / "config.json":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert _refusal_before_listening(tiny_model, monkeypatch, capsys) == (
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): cannot read {tiny_model / 'config.json'}: "
        "Permission denied\n"
    )


@pytest.mark.parametrize("vision", [False, True], ids=["text", "vision-language"])
def test_a_vocab_size_not_a_positive_integer_is_refused_by_the_table_check_before_the_tokenizers(
    tiny_model: Path,
    tiny_llava: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    vision: bool,
) -> None:
    """The table's check runs first and refuses it, so the tokenizer's count never meets such a value
    (it used to step aside for one, leaving it to the load)."""
    model = Path(shutil.copytree(tiny_llava if vision else tiny_model, tmp_path / "odd"))
    hf_config = json.loads((model / "config.json").read_text())
    if vision:
        hf_config["text_config"]["vocab_size"] = "many"
        said = f"config.json in {model}: text_config needs hidden_size and vocab_size"
    else:
        hf_config["vocab_size"] = "many"
        said = f"config.json in {model}: vocab_size must be a positive integer, got 'many'"
    (model / "config.json").write_text(json.dumps(hf_config))
    assert _refusal_before_listening(model, monkeypatch, capsys) == (
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): {said}\n"
    )


def test_a_token_table_file_that_does_not_parse_is_refused_before_listening_naming_model(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found only by the load, after 'listening on': exit 1, an ERROR line among four (the decoder, on
    the same file: one line naming --model, exit 2)."""
    model = Path(shutil.copytree(tiny_model, tmp_path / "truncated"))
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = _refusal_before_listening(model, monkeypatch, capsys)
    assert err.startswith(
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): {weights} is not a readable safetensors "
        "file: "
    ), err
    assert err.count("\n") == 1


def test_a_vision_checkpoints_weight_file_that_does_not_parse_is_refused_before_listening_naming_model(
    tiny_llava: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its table is found by listing the file's weights, which let SafetensorError (or OSError) through:
    a traceback at start, exit 1."""
    model = Path(shutil.copytree(tiny_llava, tmp_path / "truncated"))
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = _refusal_before_listening(model, monkeypatch, capsys)
    assert err.startswith(
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): {weights} is not a readable safetensors "
        "file: "
    ), err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("architectures", "got", "extra"),
    [
        (5, "int", {}),
        ({"a": 1}, "dict", {}),
        ([["LlamaForCausalLM"]], "a list holding list", {}),
        (5, "int", {"vision_config": {}}),  # the vision tower's architecture check read it first
    ],
)
def test_architectures_not_a_list_of_names_is_refused_before_listening_naming_model(
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    architectures: object,
    got: str,
    extra: dict[str, object],
) -> None:
    """The vision-language test raised TypeError or KeyError on it: a traceback at start, exit 1."""
    model = Path(shutil.copytree(tiny_model, tmp_path / "odd"))
    hf_config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf_config, "architectures": architectures, **extra}))
    assert _refusal_before_listening(model, monkeypatch, capsys) == (
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): config.json in {model}: architectures must "
        f"be a list of names, got {got}\n"
    )


def test_a_vision_tower_of_an_unsupported_architecture_is_refused_before_listening_naming_model(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found only by the load, after 'listening on' (exit 1)."""
    model = Path(shutil.copytree(tiny_model, tmp_path / "qwen2vl"))
    hf_config = json.loads((model / "config.json").read_text())
    architectures = ["Qwen2VLForConditionalGeneration"]
    (model / "config.json").write_text(
        json.dumps({**hf_config, "architectures": architectures, "vision_config": {}})
    )
    err = _refusal_before_listening(model, monkeypatch, capsys)
    assert err.startswith(
        "tandem serve encoder: --model (TANDEM_ENCODER_MODEL): config.json: vision-language architecture "
        "'Qwen2VLForConditionalGeneration' is not supported"
    ), err
    assert err.count("\n") == 1


def _write_adapter(adapter: Path, damage: str) -> str:
    """A prompt-tuning adapter for the tiny checkpoint (hidden size 64) with `damage` done; returns what
    the refusal says after the adapter's path."""
    if damage == "empty":
        adapter.mkdir()
        return f"adapter_config.json not found in {adapter}"
    write_prompt_adapter(adapter, num_virtual_tokens=3, token_dim=32 if damage == "token_dim" else 64)
    config_path = adapter / "adapter_config.json"
    if damage == "token_dim":
        return "adapter_config.json: token_dim 32 does not match the model's hidden_size 64"
    if damage == "peft_type":
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "peft_type": "LORA"}))
        return f"adapter_config.json in {adapter}: peft_type is 'LORA'"
    if damage == "num_virtual_tokens":
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "num_virtual_tokens": 5}))
        return "prompt_embeddings has shape [3, 64], expected [num_virtual_tokens, token_dim] = [5, 64]"
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"not safetensors")
    return f"{weights} is not a readable safetensors file: "


@pytest.mark.parametrize("damage", ["empty", "peft_type", "token_dim", "num_virtual_tokens", "weights"])
def test_an_adapter_the_load_would_refuse_is_refused_before_listening_naming_adapter(
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    damage: str,
) -> None:
    """Found only by the load, after 'listening on': exit 1, an ERROR line naming no flag."""
    adapter = tmp_path / "adapter"
    said = _write_adapter(adapter, damage)
    flags = ("--embedder", "soft-prompt", "--adapter", str(adapter))
    err = _refusal_before_listening(tiny_model, monkeypatch, capsys, *flags)
    assert err.startswith(f"tandem serve encoder: --adapter (TANDEM_ENCODER_ADAPTER): {said}"), err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "damage", ["encoder_model_empty", "projector_garbage", "projector_input", "projector_output"]
)
def test_a_projector_setup_the_load_would_refuse_is_refused_before_listening_naming_its_flag(
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    damage: str,
) -> None:
    """Found only by the load, after 'listening on': exit 1, an empty --encoder-model in eight lines
    ending with transformers' advice to install sentencepiece."""
    encoder_model, projector = tmp_path / "encoder", tmp_path / "projector.safetensors"
    encoder_model.mkdir()
    if damage != "encoder_model_empty":
        (encoder_model / "config.json").write_text(json.dumps({"hidden_size": 8}))
    in_features = 16 if damage == "projector_input" else 8
    write_random_projector(
        projector, in_features, 32 if damage == "projector_output" else 64, layout="linear"
    )
    if damage == "projector_garbage":
        projector.write_bytes(b"not safetensors")
    encoder_flag, projector_flag = (
        "--encoder-model (TANDEM_ENCODER_ENCODER_MODEL)",
        "--projector (TANDEM_ENCODER_PROJECTOR)",
    )
    said = {
        "encoder_model_empty": f"{encoder_flag}: config.json not found in {encoder_model}",
        "projector_garbage": f"{projector_flag}: {projector} is not a readable safetensors file",
        "projector_input": f"{projector_flag}: {projector}: projector input width 16 does not match the "
        "encoder's hidden_size 8",
        "projector_output": f"{projector_flag}: {projector}: projector output width 32 does not match the "
        "decoder's hidden_size 64",
    }[damage]
    flags = ("--embedder", "projector", "--encoder-model", str(encoder_model), "--projector", str(projector))
    err = _refusal_before_listening(tiny_model, monkeypatch, capsys, *flags)
    assert err.startswith(f"tandem serve encoder: {said}"), err
    assert err.count("\n") == 1


def test_the_start_checks_pass_a_projector_setup_the_load_takes(tiny_model: Path, tmp_path: Path) -> None:
    """Headers and configs alone: transformers is not needed to check, only to load."""
    encoder_model, projector = tmp_path / "encoder", tmp_path / "projector.safetensors"
    encoder_model.mkdir()
    (encoder_model / "config.json").write_text(json.dumps({"hidden_size": 8}))
    write_random_projector(projector, 8, 64, layout="mlp", prefix=LLAVA_PREFIX)
    config = EncoderConfig(
        model_dir=tiny_model, embedder="projector", encoder_model_dir=encoder_model, projector_path=projector
    )
    assert encoder_main.check_start(config) is None
