"""`tandem up` as a process: both services come up, SIGTERM stops both, a dead service stops the other."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.tests.ports import free_port
from services.decoder.tests.conftest import _build_checkpoint
from tandem import cli
from tandem.client.errors import ConfigError
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc
from tandem.common.torch_part.random_model import make_model, train_tokenizer
from tandem.up import check_decoder_fits
from tandem.up_commands import serve_command
from tandem.up_config import UpConfig
from tests.integration.test_images import dockerfile_healthcheck_command

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180.0  # the default-model case imports the GGUF file first
GRACE_S = 20.0
SERVING = health_pb2.HealthCheckResponse.SERVING
UP = [sys.executable, "-m", "tandem.cli", "up", "--dtype", "float32", "--grace-s", str(GRACE_S)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("up-model"))


def _start_up(
    args: list[str], log: Path, home: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`tandem up` as a terminal runs it: a process group of its own, which a Ctrl-C signals whole."""
    env = {**os.environ, **(env or {}), **({"HOME": str(home)} if home is not None else {})}
    with log.open("w") as out:
        return subprocess.Popen(
            [*UP, *args], stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env, start_new_session=True
        )


def _health(port: int) -> int | None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        try:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            return None


def _wait_serving(up: subprocess.Popen, ports: list[int], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not all(_health(port) == SERVING for port in ports):
        assert up.poll() is None, f"tandem up exited with {up.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"not SERVING within {STARTUP_TIMEOUT_S} s:\n{log.read_text()}"
        time.sleep(0.2)


def _wait_for_line(up: subprocess.Popen, log: Path, start: str) -> str:
    """The first line of `up`'s output that starts with `start`, once it is there."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        found = [line for line in log.read_text().splitlines() if line.startswith(start)]
        if found:
            return found[0]
        assert up.poll() is None, f"tandem up exited with {up.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {start!r} within {STARTUP_TIMEOUT_S} s:\n{log.read_text()}"
        time.sleep(0.2)


def _children(pid: int) -> dict[str, int]:
    """Service name -> pid of `pid`'s child processes, from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"serve" in cmdline:
            found[cmdline[cmdline.index(b"serve") + 1].decode()] = int(entry.name)
    return found


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def _run_image_healthcheck(ports: list[int]) -> int:
    """The Dockerfile's HEALTHCHECK command, run as Docker runs it (`sh -c`), against `ports`."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # `python` is this venv's
        "TANDEM_HEALTH_PORTS": " ".join(map(str, ports)),
    }
    command = ["sh", "-c", dockerfile_healthcheck_command()]
    return subprocess.run(command, env=env, capture_output=True, timeout=30).returncode


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def test_serve_command_passes_dtype_to_both_and_world_size_and_device_to_the_decoder_only() -> None:
    config = UpConfig(Path("/m"), "0.0.0.0", 1, 2, "float32", world_size=2, device="neuron", grace_s=1.0)
    assert serve_command("encoder", config) == [
        "serve", "encoder", "--model", "/m", "--host", "0.0.0.0", "--port", "1", "--dtype", "float32",
        "--grace-s", "1",
    ]  # fmt: skip
    assert serve_command("decoder", config)[-10:] == [
        "--dtype", "float32", "--world-size", "2", "--device", "neuron", "--grace-s", "1",
        "--encoder", "127.0.0.1:1",
    ]  # fmt: skip


def test_serve_command_points_the_decoder_at_the_encoder_for_its_encoder_parts() -> None:
    config = UpConfig(Path("/m"), "10.0.0.5", 7, 8, dtype=None, world_size=None)
    decoder = serve_command("decoder", config)
    assert decoder[decoder.index("--encoder") + 1] == "10.0.0.5:7"
    assert "--encoder" not in serve_command("encoder", config)
    with_tls = UpConfig(Path("/m"), "10.0.0.5", 7, 8, None, None, tls_cert=Path("c"), tls_key=Path("k"))
    assert "--encoder" not in serve_command("decoder", with_tls)  # its channel to the encoder is plaintext


def test_serve_command_passes_gguf_quantization_to_the_decoder_only() -> None:
    # The encoder's table imported from the file already holds the file's values.
    config = UpConfig(Path("/m.gguf"), "127.0.0.1", 1, 2, dtype=None, world_size=None, quantization="gguf")
    assert "--quantization" not in serve_command("encoder", config)
    decoder = serve_command("decoder", config)
    assert decoder[decoder.index("--quantization") + 1] == "gguf"
    plain = UpConfig(Path("/m.gguf"), "127.0.0.1", 1, 2, dtype=None, world_size=None)
    assert "--quantization" not in serve_command("decoder", plain)


def test_serve_command_passes_int4_to_both_services_and_its_group_size_to_the_decoder() -> None:
    # The encoder rounds its lookup table as the decoder rounds the model's table (8-bit per row,
    # whatever the linears' group): the same rows.
    config = UpConfig(
        Path("/m"), "127.0.0.1", 1, 2, None, None, quantization="int4", quantization_group_size=64
    )
    encoder, decoder = serve_command("encoder", config), serve_command("decoder", config)
    assert encoder[encoder.index("--quantization") + 1] == "int4"
    assert decoder[decoder.index("--quantization") + 1] == "int4"
    assert decoder[decoder.index("--quantization-group-size") + 1] == "64"
    assert "--quantization-group-size" not in encoder


def test_services_stop_when_up_is_killed_outright(model_dir: Path, tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    args = ["--model", str(model_dir), "--encoder-port", str(ports[0]), "--decoder-port", str(ports[1])]
    up = _start_up(args, tmp_path / "up.log")
    try:
        _wait_serving(up, ports, tmp_path / "up.log")
        children = _children(up.pid)
    finally:
        _stop(up)  # SIGKILL: `up` gets no chance to stop them itself
    deadline = time.monotonic() + 30
    while any(_is_running(pid) for pid in children.values()):
        assert time.monotonic() < deadline, "a service outlived `up`"
        time.sleep(0.2)


def test_up_serves_both_on_the_default_model_until_sigterm_then_exits_zero(tmp_path: Path) -> None:
    encoder_port, decoder_port = free_port(), free_port()
    log = tmp_path / "up.log"
    # A fresh HOME: `up` imports the default model's GGUF file there first, once for both services.
    # The services' own variables for what `up` decides are not theirs to read under `up`
    # (docs/CONFIGURATION.md): left in the environment they would have a service load another model, or
    # round it otherwise, than what `up` checked (each of these values would stop a service).
    elsewhere = str(tmp_path / "no-such-model")
    owned = {"TANDEM_MODEL": elsewhere, "TANDEM_ENCODER_MODEL": elsewhere, "TANDEM_QUANTIZATION": "int4"}
    owned |= {"TANDEM_QUANTIZATION_GROUP_SIZE": "7", "TANDEM_DTYPE": "fp3", "TANDEM_ENCODER_DTYPE": "fp3"}
    up = _start_up(
        ["--encoder-port", str(encoder_port), "--decoder-port", str(decoder_port)],
        log,
        home=tmp_path,
        env=owned,
    )
    try:
        _wait_serving(up, [encoder_port, decoder_port], log)
        ready = _wait_for_line(up, log, "[up] ready: ")  # said once both serve
        assert ready == (
            f"[up] ready: the encoder on 127.0.0.1:{encoder_port}, the decoder on 127.0.0.1:{decoder_port}. "
            f"Ctrl-C stops them (in the background: kill {up.pid})"
        )
        imported = [p for p in (tmp_path / ".cache" / "tandem" / "models").iterdir() if p.is_dir()]
        assert [p.name.startswith("SmolLM2-135M-Instruct-") for p in imported] == [True]
        children = _children(up.pid)
        assert set(children) == {"encoder", "decoder"}
        assert _run_image_healthcheck([encoder_port, decoder_port]) == 0

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=GRACE_S + 5) == 0, log.read_text()
        assert not any(_is_running(pid) for pid in children.values())
        assert _health(encoder_port) is None and _health(decoder_port) is None
        assert _run_image_healthcheck([encoder_port, decoder_port]) == 1
    finally:
        _stop(up)
    output = log.read_text()
    assert "[encoder] " in output and "[decoder] " in output  # the services' own log lines, prefixed
    assert "grace period over" not in output  # nothing was open: the drain did not wait out the grace
    lines = output.splitlines()
    assert [line for line in lines if line.startswith("[up] ready")] == [ready]  # once, after both serve
    serving = [i for i, line in enumerate(lines) if " serving SmolLM2-135M-Instruct on port " in line]
    assert len(serving) == 2 and max(serving) < lines.index(ready)
    assert "[up] the encoder stopped (exit 0)" in output and "[up] the decoder stopped (exit 0)" in output


def test_up_exits_nonzero_and_stops_the_encoder_when_the_decoder_dies(
    tmp_path: Path, model_dir: Path
) -> None:
    encoder_port, decoder_port = free_port(), free_port()
    log = tmp_path / "up.log"
    up = _start_up(
        ["--model", str(model_dir), "--encoder-port", str(encoder_port), "--decoder-port", str(decoder_port)],
        log,
    )
    try:
        _wait_serving(up, [encoder_port, decoder_port], log)
        children = _children(up.pid)
        os.kill(children["decoder"], signal.SIGKILL)
        assert up.wait(timeout=GRACE_S + 5) != 0
        assert not _is_running(children["encoder"])
        assert _health(encoder_port) is None
    finally:
        _stop(up)
    output = log.read_text()
    assert "the decoder exited on its own" in output
    assert "[up] the encoder stopped (exit 0)" in output


def test_ctrl_c_during_a_stream_ends_it_aborted_at_the_grace_with_its_span_and_no_traceback(
    model_dir: Path, tmp_path: Path
) -> None:
    ports = [free_port(), free_port()]
    log = tmp_path / "up.log"
    args = ["--model", str(model_dir), "--encoder-port", str(ports[0]), "--decoder-port", str(ports[1])]
    # One grace for everything: the services and the gateway get up's, not their own default (30 s).
    args += ["--openai-port", str(free_port())]
    up = _start_up([*args, "--grace-s", "2"], log, env={"OTEL_TRACES_EXPORTER": "console"})
    try:
        _wait_for_line(up, log, "[up] ready")  # the gateway's /health too
        with grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as channel:
            request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(text="Once")])
            request.stopping.max_new_tokens = 4000
            request.stopping.ignore_eos = True
            stream = decoder_pb2_grpc.DecoderStub(channel).Generate(request, timeout=60)
            assert next(stream).HasField("accepted")
            os.killpg(up.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
            responses = list(stream)  # the stream ends OK: no UNAVAILABLE "Cancelling all calls"
        assert up.wait(timeout=30) == 0, log.read_text()
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    finished = responses[-1].finished
    assert finished.reason == decoder_pb2.FINISH_REASON_ABORTED
    assert 0 < finished.usage.output_tokens < 4000
    assert finished.usage.output_tokens == sum(len(r.delta.token_ids) for r in responses)
    output = log.read_text()
    assert "Traceback" not in output and " ERROR " not in output and "CancelledError" not in output, output
    assert "Shutdown called, ignoring Span" not in output
    for service in ("encoder", "decoder", "openai"):  # one signal each: up's, never the terminal's SIGINT
        lines = [line for line in output.splitlines() if line.startswith(f"[{service}] ")]
        assert sum("received SIGTERM: draining for up to 2 s" in line for line in lines) == 1, output
        assert not any("SIGINT" in line for line in lines), output
    assert "1 open requests end with FINISH_REASON_ABORTED" in output
    # The cut stream's span, printed by the decoder's console exporter when it stopped.
    decoder_json = "\n".join(
        line.removeprefix("[decoder] ") for line in output.splitlines() if line.startswith("[decoder] ")
    )
    assert '"gen_ai.response.finish_reasons": [\n' in decoder_json and '"aborted"' in decoder_json, output


def test_a_port_in_use_is_one_line_and_exit_2_before_any_service_starts(
    model_dir: Path, environ, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        argv = [
            "up",
            "--model",
            str(model_dir),
            "--encoder-port",
            str(free_port()),
            "--decoder-port",
            str(busy),
        ]
        assert cli.main(argv) == 2
    assert capsys.readouterr() == (
        "",
        f"tandem up: --decoder-port (TANDEM_UP_DECODER_PORT) {busy} is in use on 127.0.0.1: "
        "another process listens there\n",
    )


def test_a_world_size_the_model_cannot_shard_is_one_line_about_ups_own_flag_before_any_service_starts(
    model_dir: Path, environ, capsys: pytest.CaptureFixture[str]
) -> None:
    # It used to start both services, then relay the decoder's 10 lines naming TANDEM_WORLD_SIZE, exit 1.
    ports = ["--encoder-port", str(free_port()), "--decoder-port", str(free_port())]
    assert cli.main(["up", "--model", str(model_dir), *ports, "--world-size", "3"]) == 2
    assert capsys.readouterr() == (
        "",
        "tandem up: --world-size (TANDEM_UP_WORLD_SIZE): num_heads (4) must be divisible by the world "
        "size (3) to shard the model\n",
    )
    environ({"TANDEM_UP_QUANTIZATION": "int4", "TANDEM_UP_QUANTIZATION_GROUP_SIZE": "4096"})
    assert cli.main(["up", "--model", str(model_dir), *ports]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(
        "tandem up: --quantization-group-size (TANDEM_UP_QUANTIZATION_GROUP_SIZE) int4 cannot quantize"
    ), err


def test_on_neuron_a_world_size_that_does_not_divide_the_heads_passes_ups_check_as_the_decoder_takes_it(
    model_dir: Path,
) -> None:
    # Neuron's devices are one SPMD program that runs attention whole when the heads do not divide
    # (SmolLM2's 9 on 2 devices): the README's `up --device neuron --world-size 2` was refused here.
    ports = {"encoder_port": 1, "decoder_port": 2}
    on_neuron = UpConfig(model_dir, "127.0.0.1", **ports, dtype="float32", world_size=3, device="neuron")
    check_decoder_fits(on_neuron, model_dir)
    on_cpu = UpConfig(model_dir, "127.0.0.1", **ports, dtype="float32", world_size=3, device="cpu")
    with pytest.raises(ConfigError, match=r"num_heads \(4\) must be divisible by the world size \(3\)"):
        check_decoder_fits(on_cpu, model_dir)


def test_a_gguf_files_template_that_does_not_compile_is_named_as_the_files_field(
    model_dir: Path, tmp_path: Path
) -> None:
    # up checks the import in the model cache; the operator named the GGUF file, whose
    # tokenizer.chat_template the import wrote to that directory's chat_template.jinja.
    imported = tmp_path / "imported"
    shutil.copytree(model_dir, imported)
    (imported / "chat_template.jinja").write_text("{{ messages | no_such_filter }}")
    gguf_file = tmp_path / "Model.Q4_1.gguf"
    config = UpConfig(gguf_file, "127.0.0.1", 1, 2, dtype="float32", world_size=None)
    said = f"{gguf_file}: tokenizer.chat_template: the template does not compile: line 1: No filter"
    with pytest.raises(ConfigError, match=re.escape(said)):
        check_decoder_fits(config, imported)


def test_a_window_narrower_than_the_context_is_one_line_naming_the_decoders_flag_before_any_service_starts(
    tmp_path: Path, environ, capsys: pytest.CaptureFixture[str]
) -> None:
    # It used to start both services, then relay the decoder's refusal (exit 2) and exit 1 itself.
    train_tokenizer().save(str(tokenizer_file := tmp_path / "tokenizer.json"))
    model_dir = _build_checkpoint("mistral", tmp_path / "mistral", tokenizer_file).path
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"sliding_window": 64}))  # of 512 positions
    capsys.readouterr()  # transformers' output while it saved
    ports = ["--encoder-port", str(free_port()), "--decoder-port", str(free_port())]
    assert cli.main(["up", "--model", str(model_dir), *ports]) == 2
    assert capsys.readouterr() == (
        "",
        "tandem up: the decoder's --max-model-len (TANDEM_MAX_MODEL_LEN) must be at most 64 to serve this "
        "checkpoint, got 512 (config.json's max_position_embeddings): config.json's sliding_window 64 "
        "narrows what each query attends to, and this decoder attends to the whole context "
        "(sliding-window attention is not implemented)\n",
    )
    # The decoder's own variable, which `up` leaves to it, decides: as wide as the window it is served.
    up_config = UpConfig(model_dir, "127.0.0.1", 1, 2, dtype="float32", world_size=None)
    environ({"TANDEM_MAX_MODEL_LEN": "65"})
    with pytest.raises(ConfigError, match=r"must be at most 64 to serve this checkpoint, got 65:"):
        check_decoder_fits(up_config, model_dir)
    environ({"TANDEM_MAX_MODEL_LEN": "64"})
    check_decoder_fits(up_config, model_dir)


def test_openai_port_adds_the_gateway_in_front_of_both_services() -> None:
    from tandem.up_config import services

    config = UpConfig(None, "0.0.0.0", 50051, 50052, None, None, openai_port=8000)
    assert services(config) == ("encoder", "decoder", "openai")
    assert serve_command("openai", config) == [
        "serve", "openai", "--host", "0.0.0.0", "--port", "8000",
        "--decoder-address", "127.0.0.1:50052", "--encoder-address", "127.0.0.1:50051", "--grace-s", "30",
    ]  # fmt: skip
    assert services(UpConfig(None, "127.0.0.1", 50051, 50052, None, None)) == ("encoder", "decoder")
    with pytest.raises(ConfigError, match="must differ"):
        UpConfig(None, "127.0.0.1", 50051, 50052, None, None, openai_port=50052)
