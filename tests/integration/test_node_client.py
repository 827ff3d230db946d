"""The Node.js client (clients/node) against a live decoder: streaming, embedding segments, errors."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc
from services.decoder.models.random_model import make_model

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_CLIENT = REPO_ROOT / "clients" / "node"
PROMPT = "Once upon a time"


@dataclass
class LiveDecoder:
    address: str
    stub: decoder_pb2_grpc.DecoderStub
    hidden_size: int


@pytest.fixture(scope="module")
def node_client() -> Path:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("npm/node are not installed: the Node.js client cannot be tested")
    result = subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_CLIENT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return NODE_CLIENT / "generate.js"


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveDecoder]:
    model_dir = make_model(tmp_path_factory.mktemp("node-model"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--model", str(model_dir), "--port", str(port), "--dtype", "float32", "--num-threads", "1"]
    command = [sys.executable, "-m", "services.decoder", *argv]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"the decoder exited with {process.returncode}"
            assert time.monotonic() < deadline, "the decoder did not become SERVING within 60 s"
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:  # SERVING
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        stub = decoder_pb2_grpc.DecoderStub(channel)
        info = stub.GetModelInfo(decoder_pb2.DecoderGetModelInfoRequest(), timeout=10)
        yield LiveDecoder(f"127.0.0.1:{port}", stub, info.hidden_size)
    finally:
        channel.close()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _run_node(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["node", str(script), *args], capture_output=True, text=True, timeout=60)


def _text_and_summary(stdout: str) -> tuple[str, dict]:
    text, _, last_line = stdout.rstrip("\n").rpartition("\n")
    return text, json.loads(last_line)


def _prompt_tokens(decoder: LiveDecoder, text: str) -> int:
    reply = decoder.stub.Tokenize(decoder_pb2.DecoderTokenizeRequest(texts=[text]), timeout=10)
    return len(reply.tokens[0].ids)


def test_node_client_streams_the_same_tokens_as_the_python_stub(
    node_client: Path, decoder: LiveDecoder
) -> None:
    result = _run_node(node_client, decoder.address, PROMPT, "12", "--ignore-eos", "--seed", "5")
    assert result.returncode == 0, result.stderr
    text, summary = _text_and_summary(result.stdout)
    assert summary["finish_reason"] == "FINISH_REASON_LENGTH"
    assert summary["output_tokens"] == summary["streamed_tokens"] == 12
    assert summary["prompt_tokens"] == _prompt_tokens(decoder, PROMPT)

    # The reference: the same seeded request through the generated Python stub.
    request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(text=PROMPT)])
    request.stopping.max_new_tokens = 12
    request.stopping.ignore_eos = True
    request.sampling.seed = 5
    responses = decoder.stub.Generate(request, timeout=60)
    expected = "".join(r.delta.text for r in responses if r.HasField("delta"))
    assert text == expected


def test_node_client_sends_an_embedding_segment_before_the_text(
    node_client: Path, decoder: LiveDecoder
) -> None:
    args = ["--embedding-rows", "3", "--hidden", str(decoder.hidden_size), "--ignore-eos"]
    result = _run_node(node_client, decoder.address, PROMPT, "4", *args)
    assert result.returncode == 0, result.stderr
    _, summary = _text_and_summary(result.stdout)
    assert summary["prompt_tokens"] == 3 + _prompt_tokens(decoder, PROMPT)
    assert summary["output_tokens"] == summary["streamed_tokens"] == 4
    assert summary["finish_reason"] == "FINISH_REASON_LENGTH"


def test_mis_shaped_embedding_is_invalid_argument_naming_the_field(
    node_client: Path, decoder: LiveDecoder
) -> None:
    args = ["--embedding-rows", "2", "--hidden", str(decoder.hidden_size + 1)]
    result = _run_node(node_client, decoder.address, PROMPT, "4", *args)
    assert result.returncode == 1
    error = json.loads(result.stderr.strip().splitlines()[-1])["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert "prompt[0].embeddings.shape" in error["details"]
    assert result.stdout == ""


def test_node_chat_streams_a_reply_through_the_models_template(
    node_client: Path, decoder: LiveDecoder
) -> None:
    chat = node_client.with_name("chat.js")
    result = _run_node(
        chat, decoder.address, "Once upon a time", "--system", "Be brief.", "--max-tokens", "8"
    )
    assert result.returncode == 0, result.stderr
    text, summary = _text_and_summary(result.stdout)
    request = decoder_pb2.GenerateRequest(stopping=decoder_pb2.StoppingCriteria(max_new_tokens=8))
    request.sampling.temperature = 0
    for role, content in (("system", "Be brief."), ("user", "Once upon a time")):
        request.chat.messages.add(role=role).content.add(text=content)
    expected = "".join(
        r.delta.text for r in decoder.stub.Generate(request, timeout=60) if r.HasField("delta")
    )
    assert text == expected
    assert summary["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS")
    assert summary["output_tokens"] >= 1
