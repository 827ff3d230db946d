"""The Node.js client (clients/node) against live services: streaming, embedding segments, errors,
TLS and bearer tokens, the encoder, and balancing over replicas with health checking."""

from __future__ import annotations

import base64
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.tests.ports import free_port
from tandem.client.auth import load_tokens
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from tandem.common.server import TlsOptions
from tandem.common.torch_part import tensors
from tandem.common.torch_part.random_model import make_model
from tandem.decoder.models.loader import LoadedModel
from tests.integration.package_index import npm_ci
from tests.integration.reliability.harness import Services
from tests.integration.test_security import OPENSSL, make_pki

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
    npm_ci(NODE_CLIENT)
    return NODE_CLIENT / "generate.js"


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveDecoder]:
    model_dir = make_model(tmp_path_factory.mktemp("node-model"))
    port = free_port()
    argv = ["--model", str(model_dir), "--port", str(port), "--dtype", "float32", "--num-threads", "1"]
    command = [sys.executable, "-m", "tandem.decoder", *argv]
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


def _node_eval(node_client: Path, script: str) -> str:
    """What `script` prints, run by node beside the client's modules (no service needed)."""
    result = subprocess.run(
        ["node", "-e", script], cwd=node_client.parent, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _node_chat_request(node_client: Path, messages: str) -> decoder_pb2.GenerateRequest:
    """chatRequest(`messages`, a JavaScript array) serialized as grpc-js sends it and read back here: no
    decoder needed."""
    script = (
        'const { chatRequest } = require("./decoder");'
        'const loader = require("@grpc/proto-loader");'
        'const definition = loader.loadSync("tandem/v1/decoder.proto",'
        ' {includeDirs: ["../../protos"], keepCase: true});'
        f"const request = chatRequest({messages});"
        'process.stdout.write(definition["tandem.v1.Decoder"].Generate.requestSerialize(request).toString("base64"));'
    )
    return decoder_pb2.GenerateRequest.FromString(base64.b64decode(_node_eval(node_client, script)))


def test_node_chat_request_carries_a_turns_name_and_a_turn_without_one_sends_none(node_client: Path) -> None:
    # ChatMessage.name (30308ec) reaches templates that print it; chatRequest mapped {role, content} only.
    request = _node_chat_request(
        node_client, '[{role: "user", name: "alice", content: "hi"}, {role: "assistant", content: "yo"}]'
    )
    named, unnamed = request.chat.messages
    assert (named.role, named.HasField("name"), named.name) == ("user", True, "alice")
    assert (unnamed.role, unnamed.HasField("name")) == ("assistant", False)


def test_node_chat_request_sends_a_turn_with_no_content_parts_as_one_of_empty_text(node_client: Path) -> None:
    # content [] was sent as a turn of no parts, which the decoder refuses, and null or absent content threw
    # a TypeError here; the gateway renders all three as empty text, as vLLM does (595fa60).
    request = _node_chat_request(
        node_client, '[{role: "assistant", content: []}, {role: "user", content: null}, {role: "user"}]'
    )
    turns = [
        [(part.WhichOneof("part"), part.text) for part in turn.content] for turn in request.chat.messages
    ]
    assert turns == [[("text", "")]] * 3


def _node_chat_request_errors(node_client: Path, values: str, second_turn: str) -> list[str]:
    """chatRequest([a turn of "hi", `second_turn`]) for each of `values` (a JavaScript array, each bound to
    `value` in `second_turn`): its error's message, or "sent"."""
    script = (
        'const { chatRequest } = require("./decoder");'
        f"for (const value of {values}) {{"
        f'  try {{ chatRequest([{{role: "user", content: "hi"}}, {second_turn}]);'
        '    console.log("sent"); } catch (error) { console.log(error.message); } }'
    )
    return _node_eval(node_client, script).splitlines()


def test_node_chat_request_refuses_a_name_that_is_not_a_string_naming_it(node_client: Path) -> None:
    # String() sent ["alice"] to the template as "alice" and 123 as "123", where the gateway refuses them.
    errors = _node_chat_request_errors(
        node_client, '[["alice"], 123, false, {a: 1}]', '{role: "user", content: "yo", name: value}'
    )
    kinds = ["object", "number", "boolean", "object"]
    assert errors == [f"messages[1].name: must be a string, got {k}" for k in kinds]


def test_node_chat_request_refuses_a_content_neither_a_string_nor_a_list_naming_it(node_client: Path) -> None:
    # false, 0, {} and a part object not in a list threw "content.map is not a function", naming no field;
    # the gateway refuses each as messages[i].content.
    errors = _node_chat_request_errors(
        node_client, '[false, 0, {}, {type: "text", text: "hi"}]', '{role: "user", content: value}'
    )
    kinds = ["boolean", "number", "object", "object"]
    assert errors == [
        f"messages[1].content: must be a string or a list of content parts, got {k}" for k in kinds
    ]


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


def test_node_client_constrains_the_answer_with_a_json_schema_a_regex_or_a_choice(
    node_client: Path, decoder: LiveDecoder, tmp_path: Path
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    result = _run_node(
        node_client, decoder.address, PROMPT, "32", "--json-schema", str(tmp_path / "schema.json")
    )
    assert result.returncode == 0, result.stderr
    text, summary = _text_and_summary(result.stdout)
    assert summary["finish_reason"] == "FINISH_REASON_EOS" and 0 <= json.loads(text)["n"] <= 9
    result = _run_node(node_client, decoder.address, PROMPT, "16", "--regex", "[a-c]{4}")
    assert re.fullmatch("[a-c]{4}", _text_and_summary(result.stdout)[0]), result.stdout
    result = _run_node(node_client, decoder.address, PROMPT, "16", "--choice", "left,right")
    assert _text_and_summary(result.stdout)[0] in ("left", "right")


def test_node_client_balances_over_replicas_skipping_one_that_is_not_serving(
    node_client: Path, decoder: LiveDecoder
) -> None:
    """A second server that only answers health, NOT_SERVING: without health checking, every other
    call would go there and fail UNIMPLEMENTED."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for address in (f"{decoder.address},127.0.0.1:{port}", f"127.0.0.1:{port},{decoder.address}"):
            for _ in range(3):
                result = _run_node(node_client, address, PROMPT, "2", "--ignore-eos")
                assert result.returncode == 0, result.stderr
                assert _text_and_summary(result.stdout)[1]["output_tokens"] == 2
    finally:
        server.stop(0)


TOKEN = "node-test-token-5c1e"


@pytest.fixture(scope="module")
def tls_services(tiny_model_dir: Path, tiny_fp32: LoadedModel, tmp_path_factory: pytest.TempPathFactory):
    if OPENSSL is None:
        pytest.skip("the openssl CLI makes the test certificates")
    directory = tmp_path_factory.mktemp("node-pki")
    pki = make_pki(directory)
    token_file = directory / "tokens.txt"
    token_file.write_text(f"# the accepted token\n{TOKEN}\n")
    running = Services(
        tiny_model_dir,
        tiny_fp32,
        tls=TlsOptions(pki.server_cert, pki.server_key),
        auth_tokens=load_tokens(token_file),
    )
    yield running, ["--tls-ca", str(pki.ca), "--auth-token-file", str(token_file)], str(pki.ca)
    running.close()


def test_node_clients_speak_tls_and_bearer_tokens_to_both_services(node_client: Path, tls_services) -> None:
    services, security, ca = tls_services
    decoder_address, encoder_address = services.decoder_server.address, services.encoder_server.address
    result = _run_node(node_client, decoder_address, PROMPT, "3", "--ignore-eos", *security)
    assert result.returncode == 0, result.stderr
    assert _text_and_summary(result.stdout)[1]["output_tokens"] == 3
    no_token = _run_node(node_client, decoder_address, PROMPT, "3", "--tls-ca", ca)
    assert no_token.returncode == 1
    assert json.loads(no_token.stderr.strip().splitlines()[-1])["error"]["code"] == "UNAUTHENTICATED"

    embed = _run_node(NODE_CLIENT / "embed.js", encoder_address, "the quiet harbour", *security)
    assert embed.returncode == 0, embed.stderr
    summary = json.loads(embed.stdout)
    # The reference: the same Embed through the Python stub (plaintext stubs cannot reach a TLS
    # server, so through the servicer's own channel with the same credentials).
    credentials = grpc.composite_channel_credentials(
        grpc.ssl_channel_credentials(Path(ca).read_bytes()),
        grpc.access_token_call_credentials(TOKEN),
    )
    with grpc.secure_channel(encoder_address, credentials) as channel:
        reply = encoder_pb2_grpc.EncoderStub(channel).Embed(
            encoder_pb2.EmbedRequest(text="the quiet harbour"), timeout=10
        )
    rows = tensors.decode(reply.embeddings)
    assert summary["shape"] == list(rows.shape) and summary["token_ids"] == list(reply.token_ids.ids)
    assert summary["dtype"] == "DATA_TYPE_FLOAT32"
    assert summary["first_row"] == rows[0, :8].tolist()
