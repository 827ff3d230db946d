"""`python -m tandem.encoder` as a process: starts, turns SERVING, embeds, exits 0 on SIGTERM."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.tests.ports import free_port
from services.encoder.tests.vision_checkpoints import make_llava
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 15.0


def _wait_serving(channel: grpc.Channel, process: subprocess.Popen) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"encoder exited early with {process.returncode}"
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Encoder"), timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass  # not listening yet
        time.sleep(0.1)
    raise AssertionError(f"encoder not SERVING within {STARTUP_TIMEOUT_S} s")


def _serve_embed_and_stop(model_dir: Path) -> str:
    """`python -m tandem.encoder --model model_dir` until SERVING, one Embed, SIGTERM; its output."""
    port = free_port()
    command = [sys.executable, "-m", "tandem.encoder", "--model", str(model_dir), "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_ENCODER_")}
    process = subprocess.Popen(
        [*command, "--grace-s", "1"], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            _wait_serving(channel, process)
            reply = encoder_pb2_grpc.EncoderStub(channel).Embed(
                encoder_pb2.EmbedRequest(text="hi"), timeout=5
            )
            assert reply.embeddings.shape[0] == reply.usage.input_tokens >= 1
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=EXIT_TIMEOUT_S)
        assert process.returncode == 0, output.decode(errors="replace")
        return output.decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_module_serves_until_sigterm_and_exits_0(tiny_model: Path) -> None:
    output = _serve_embed_and_stop(tiny_model)
    assert "images:" not in output
    # Start-up's heap left the collector's full passes before it served (tandem.common.startup_heap).
    frozen = re.search(r"start-up heap frozen: (\d+) objects", output)
    assert frozen is not None and int(frozen.group(1)) > 10_000, output


def test_a_llava_checkpoints_log_names_the_vision_tower_it_loaded(tmp_path: Path) -> None:
    # It said only "loading the lookup embedder", nothing about the tower.
    output = _serve_embed_and_stop(make_llava(tmp_path / "llava", tower="siglip"))
    assert (
        "images: LLaVA: SigLIP vision tower (3 layers, 32 wide, 36 px input in 6 px patches), its layer 2 "
        "output through the MLP projector, 36 rows per image"
    ) in output, output
