"""docker-compose.yml, checked without a Docker engine.

The compose file goes through a real compose parser (`docker-compose config`, Debian's package,
which `.ci/run` installs when it can). The images it builds are test_images.py's.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tandem.common.server_options import DEFAULT_GRACE_S
from tandem.up_commands import serve_command
from tandem.up_config import STOP_MARGIN_S, UpConfig
from tests.integration.test_images import dockerfile, dockerfile_instructions

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
IMAGE_MODEL_DIR = "/models/SmolLM2-135M-Instruct"
PORTS = {"encoder": 50051, "decoder": 50052}
OPENAI_PORT = 8000
# How the gateway reaches the services inside the compose network: every decoder replica through DNS
# (balanced by gRPC), the one encoder by its name.
GATEWAY_UPSTREAMS = {"decoder": "dns:///decoder:50052", "encoder": "encoder:50051"}


@functools.cache
def compose_config(**environ: str) -> dict:
    """The compose file as `docker-compose config` resolves it under exactly `environ` (+ PATH)."""
    if shutil.which("docker-compose") is None:
        pytest.skip(
            "docker-compose is not installed (`.ci/run` installs Debian's package when run as root "
            "with apt available; or `apt-get install docker-compose`)"
        )
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_FILE), "config"],
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **environ},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def _up_config(model_dir: str) -> UpConfig:
    return UpConfig(
        model_dir=Path(model_dir),
        host="0.0.0.0",
        encoder_port=PORTS["encoder"],
        decoder_port=PORTS["decoder"],
        dtype=None,
        world_size=None,
        grace_s=30.0,
        openai_port=OPENAI_PORT,
    )


def _compose_argv(service: str, model_dir: str) -> list[str]:
    """`tandem up`'s argv for `service`, the decoder's encoder named as compose names it."""
    argv = serve_command(service, _up_config(model_dir))
    if service == "decoder":
        flag = argv.index("--encoder") + 1
        assert argv[flag] == f"127.0.0.1:{PORTS['encoder']}"
        argv[flag] = f"encoder:{PORTS['encoder']}"
    return argv


def test_compose_services_run_the_argv_tandem_up_runs() -> None:
    services = compose_config()["services"]
    for name in ("encoder", "decoder"):
        assert services[name]["command"] == ["tandem", *_compose_argv(name, IMAGE_MODEL_DIR)]


def test_compose_decoders_share_the_encoders_shared_memory() -> None:
    services = compose_config()["services"]
    assert services["encoder"]["ipc"] == "shareable"
    assert services["decoder"]["ipc"] == "service:encoder"


def test_compose_model_and_its_volume_are_overridable_by_environment() -> None:
    services = compose_config(TANDEM_COMPOSE_MODEL="/models/my-qwen3", TANDEM_COMPOSE_MODELS="/srv/models")[
        "services"
    ]
    for name in ("encoder", "decoder"):
        assert services[name]["command"] == ["tandem", *_compose_argv(name, "/models/my-qwen3")]
        assert services[name]["volumes"] == ["/srv/models:/models:rw"]


def test_compose_decoder_waits_for_a_healthy_encoder_and_both_share_the_models_volume() -> None:
    config = compose_config()
    services = config["services"]
    assert services["decoder"]["depends_on"]["encoder"] == {"condition": "service_healthy"}
    assert "models" in config["volumes"]
    for name, port in PORTS.items():
        assert services[name]["volumes"] == ["models:/models:rw"]
        published = f"{port}-{port + 9}" if name == "decoder" else port  # the decoder scales to 10 replicas
        assert {"published": published, "target": port} in services[name]["ports"]
        # The image's HEALTHCHECK probes these ports; each container runs one service.
        assert services[name]["environment"]["TANDEM_HEALTH_PORTS"] == str(port)


def test_compose_builds_each_service_from_its_own_dockerfile_into_its_own_image() -> None:
    services = compose_config()["services"]
    for name, image in (("encoder", "encoder"), ("decoder", "decoder"), ("openai", "gateway")):
        assert services[name]["build"] == {
            "context": str(REPO_ROOT),
            "dockerfile": str(dockerfile(image).relative_to(REPO_ROOT)),
        }
        assert services[name]["image"] == f"tandem-{image}:local"
        assert dockerfile(image).is_file()


def test_compose_sends_traces_of_both_services_and_the_gateway_to_jaeger() -> None:
    services = compose_config()["services"]
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert {"published": 16686, "target": 16686} in jaeger["ports"]  # the UI
    assert {"published": 4317, "target": 4317} in jaeger["ports"]  # OTLP gRPC in
    names = set()
    for name in ("encoder", "decoder", "openai"):
        environment = services[name]["environment"]
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert environment["OTEL_TRACES_EXPORTER"] == "otlp"
        assert "jaeger" in services[name]["depends_on"]
        names.add(environment["OTEL_SERVICE_NAME"])
    assert names == {"tandem-encoder", "tandem-decoder", "tandem-openai"}


def test_compose_gives_each_service_its_grace_period_and_time_to_stop_after_it() -> None:
    """Docker kills a container stop_grace_period after SIGTERM: the service's --grace-s plus the same
    margin `tandem up` leaves (open streams end FINISH_REASON_ABORTED, spans flush)."""
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    for name in ("encoder", "decoder"):
        command = services[name]["command"]
        grace_s = float(command[command.index("--grace-s") + 1])
        assert services[name]["stop_grace_period"] == f"{grace_s + STOP_MARGIN_S:g}s"


def test_compose_can_run_several_decoder_replicas() -> None:
    """`--scale decoder=N`: no fixed container name or host port stands in the way, each replica gets a
    host port from the range, and the encoder stays one."""
    decoder = compose_config()["services"]["decoder"]
    assert "container_name" not in decoder
    [mapping] = decoder["ports"]
    first, last = (int(p) for p in str(mapping["published"]).split("-"))
    assert (first, last - first + 1, mapping["target"]) == (PORTS["decoder"], 10, PORTS["decoder"])


def test_compose_gateway_runs_what_tandem_up_runs_with_the_services_compose_names() -> None:
    """`tandem up --openai-port 8000` points the gateway at 127.0.0.1; in compose the same argv names
    the services instead, on the ports they listen on."""
    expected = serve_command("openai", _up_config(IMAGE_MODEL_DIR))
    for service, address in GATEWAY_UPSTREAMS.items():
        flag = expected.index(f"--{service}-address") + 1
        assert expected[flag] == f"127.0.0.1:{PORTS[service]}"
        assert address.endswith(f"{service}:{PORTS[service]}")
        expected[flag] = address
    gateway = compose_config()["services"]["openai"]
    assert gateway["command"] == ["tandem", *expected]
    assert gateway["ports"] == [{"published": OPENAI_PORT, "target": OPENAI_PORT}]
    assert gateway["depends_on"]["decoder"] == {"condition": "service_healthy"}
    assert "volumes" not in gateway  # it holds no model
    # It drains as the services do (tandem.gateway.__main__ stops on DEFAULT_GRACE_S), with the same margin.
    assert gateway["stop_grace_period"] == f"{DEFAULT_GRACE_S + STOP_MARGIN_S:g}s"


class _Health(BaseHTTPRequestHandler):
    """A stand-in for the gateway's /health, answering the status its server holds."""

    def do_GET(self) -> None:
        self.send_response(self.server.health_status if self.path == "/health" else 404)  # type: ignore[attr-defined]
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_compose_gateway_is_healthy_only_while_its_health_endpoint_answers_200() -> None:
    """The image has no curl: the check is Python's urllib, which fails on a 503 (the decoder not
    serving) as on a refused connection. It runs here against a stand-in /health on a free port."""
    assert not any("curl" in args for name, args in dockerfile_instructions("gateway") if name == "RUN")
    test = compose_config()["services"]["openai"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    [code] = test[3:]
    assert f"127.0.0.1:{OPENAI_PORT}/health" in code

    def check(port: int) -> int:
        here = code.replace(f":{OPENAI_PORT}/", f":{port}/")
        return subprocess.run([sys.executable, "-c", here], capture_output=True, timeout=30).returncode

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        server.health_status = 200  # type: ignore[attr-defined]
        assert check(port) == 0
        server.health_status = 503  # type: ignore[attr-defined]
        assert check(port) != 0
    finally:
        server.shutdown()
        server.server_close()
    assert check(port) != 0  # nothing listens
