"""`python -m tandem.decoder`: loads, serves, drains on SIGTERM, exits 0; a start-up that cannot
succeed is one line and an exit code."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem.client.client import DecoderClient
from tandem.decoder.api.main import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_sigterm_drains_in_flight_streams_then_exits_zero(tiny_model_dir: Path) -> None:
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.decoder",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--grace-s",
            "60",  # generous: a loaded CI machine must not turn this into an aborted stream
            "--num-threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        async with DecoderClient(f"127.0.0.1:{port}") as client:
            for _ in range(300):
                try:
                    if await client.health(timeout=1) == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the decoder never became SERVING")
            stream = client.generate([[1, 2, 3]], max_new_tokens=600, ignore_eos=True, stream_interval=1)
            assert (await stream.read()).HasField("accepted")
            process.send_signal(signal.SIGTERM)
            responses = []
            while (response := await stream.read()) is not grpc.aio.EOF:
                responses.append(response)
            assert responses[-1].HasField("finished")
            assert responses[-1].finished.usage.output_tokens == 600
        assert process.wait(timeout=90) == 0
        output = process.stdout.read().decode(errors="replace")
        # Start-up's heap left the collector's full passes before it served (tandem.common.startup_heap).
        frozen = re.search(r"start-up heap frozen: (\d+) objects", output)
        assert frozen is not None and int(frozen.group(1)) > 10_000, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_a_missing_model_is_one_line_and_exit_2_before_anything_listens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, environ
) -> None:
    assert main(["--model", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"tandem serve decoder: --model (TANDEM_MODEL): model {tmp_path / 'missing'} does not exist "
        "(a checkpoint directory or a .gguf file)"
    )
    assert not any("listening" in r.getMessage() for r in caplog.records)


def test_a_world_size_the_model_cannot_be_sharded_over_is_one_line_before_any_rank_starts(
    smollm2_dir: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, environ
) -> None:
    assert main(["--model", str(smollm2_dir), "--world-size", "2", "--port", "0"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        "tandem serve decoder: --world-size (TANDEM_WORLD_SIZE): num_heads (9) must be divisible by the "
        "world size (2) to shard the model"
    )
    assert not any("started rank" in r.getMessage() for r in caplog.records)


def test_a_port_in_use_is_one_line_naming_the_flag(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], environ
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--model", str(tiny_model_dir), "--port", str(port)]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"tandem serve decoder: --port (TANDEM_PORT) {port} is in use on 127.0.0.1: "
        "another process listens there"
    )


def test_weights_that_do_not_load_are_one_error_line_and_exit_1(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, environ
) -> None:
    broken = Path(shutil.copytree(tiny_model_dir, tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] += 8  # the files pass every check but the weights' shapes
    (broken / "config.json").write_text(json.dumps(config))
    assert main(["--model", str(broken), "--port", "0", "--dtype", "float32"]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith(f"could not load {broken}: weight "), errors
    assert all(r.exc_info is None for r in caplog.records if r.levelno >= logging.INFO)
