"""deploy/kubernetes, checked offline: every manifest against the Kubernetes API schemas
(kubernetes-validate, strict), and against what the services and `tandem up` actually do."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tandem.common.server_options import DEFAULT_GRACE_S
from tandem.up_commands import serve_command
from tandem.up_config import STOP_MARGIN_S, UpConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = REPO_ROOT / "deploy" / "kubernetes"
IMAGE_MODEL_DIR = Path("/models/SmolLM2-135M-Instruct")  # where the init containers put the default
PORTS = {"encoder": 50051, "decoder": 50052}
OPENAI_PORT = 8000
OLDEST = "1.27"  # gRPC probes are GA from 1.27


def _resources() -> list[dict]:
    return [
        doc
        for path in sorted(MANIFESTS.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _one(kind: str, name: str) -> dict:
    [found] = [r for r in _resources() if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("version", [OLDEST, kubernetes_validate.latest_version()])
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version: str) -> None:
    resources = _resources()
    assert {(r["kind"], r["metadata"]["name"]) for r in resources} == {
        ("PersistentVolumeClaim", "tandem-models"),
        ("Deployment", "tandem-encoder"),
        ("Deployment", "tandem-decoder"),
        ("Service", "tandem-encoder"),
        ("Service", "tandem-decoder"),
        ("Deployment", "tandem-openai"),
        ("Service", "tandem-openai"),
    }
    for resource in resources:
        kubernetes_validate.validate(resource, version, strict=True)  # raises ValidationError


def test_the_validator_refuses_a_misspelt_field() -> None:
    """The check above can fail: strict validation rejects what Kubernetes would silently drop."""
    service = _one("Service", "tandem-decoder")
    broken = {**service, "spec": {**service["spec"], "clusterIp": "None"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, OLDEST, strict=True)


@pytest.mark.parametrize("service", ["encoder", "decoder"])
def test_each_deployment_runs_what_tandem_up_runs_and_stops_after_its_grace(service: str) -> None:
    spec = _one("Deployment", f"tandem-{service}")["spec"]["template"]["spec"]
    [container] = spec["containers"]
    up = UpConfig(IMAGE_MODEL_DIR, "0.0.0.0", PORTS["encoder"], PORTS["decoder"], dtype=None, world_size=None)
    expected = serve_command(service, up)
    if service == "decoder":  # its encoder by the headless Service's name, as the gateway's
        flag = expected.index("--encoder") + 1
        assert expected[flag] == f"127.0.0.1:{PORTS['encoder']}"
        expected[flag] = f"dns:///tandem-encoder:{PORTS['encoder']}"
    assert container["command"] == ["tandem", *expected]
    assert spec["terminationGracePeriodSeconds"] == up.grace_s + STOP_MARGIN_S
    assert container["ports"] == [{"name": "grpc", "containerPort": PORTS[service]}]
    resources = container["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]


@pytest.mark.parametrize("service", ["encoder", "decoder"])
def test_probes_ask_grpc_health_and_liveness_waits_for_the_model_to_load(service: str) -> None:
    [container] = _one("Deployment", f"tandem-{service}")["spec"]["template"]["spec"]["containers"]
    port = PORTS[service]
    assert container["readinessProbe"]["grpc"] == {"port": port, "service": f"tandem.v1.{service.title()}"}
    assert container["livenessProbe"]["grpc"] == {"port": port}
    startup = container["startupProbe"]
    assert startup["grpc"] == {"port": port}  # liveness starts only once the service was SERVING
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


@pytest.mark.parametrize("service", ["encoder", "decoder"])
def test_a_headless_service_lists_every_ready_pod_for_client_side_balancing(service: str) -> None:
    spec = _one("Service", f"tandem-{service}")["spec"]
    template = _one("Deployment", f"tandem-{service}")["spec"]["template"]
    assert spec["clusterIP"] == "None"
    assert spec["selector"].items() <= template["metadata"]["labels"].items()
    assert spec["ports"] == [
        {"name": "grpc", "port": PORTS[service], "targetPort": "grpc", "appProtocol": "grpc"}
    ]


@pytest.mark.parametrize("service", ["encoder", "decoder"])
def test_the_model_is_read_from_the_shared_volume_that_the_init_container_fills(service: str) -> None:
    claim = _one("PersistentVolumeClaim", "tandem-models")
    spec = _one("Deployment", f"tandem-{service}")["spec"]["template"]["spec"]
    [volume] = spec["volumes"]
    assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"]}
    [container] = spec["containers"]
    assert container["volumeMounts"] == [{"name": volume["name"], "mountPath": "/models", "readOnly": True}]
    [init] = spec["initContainers"]
    assert init["image"] == container["image"]  # the image carries the default model it copies
    assert init["volumeMounts"] == [{"name": volume["name"], "mountPath": "/volume"}]
    assert f"/volume/{IMAGE_MODEL_DIR.name}" in init["args"][0]


@pytest.mark.parametrize("service", ["encoder", "decoder", "openai"])
def test_each_deployment_runs_its_services_own_image_the_one_compose_builds(service: str) -> None:
    spec = _one("Deployment", f"tandem-{service}")["spec"]["template"]["spec"]
    images = {c["image"] for c in [*spec["containers"], *spec.get("initContainers", [])]}
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    assert images == {compose[service]["image"]}


def test_the_gateway_runs_what_tandem_up_runs_addressing_the_services_through_their_dns_names() -> None:
    """`tandem up --openai-port` points the gateway at 127.0.0.1; in the cluster it is each headless
    Service by name (`dns:///`: every ready replica, balanced by gRPC), on the port that Service serves."""
    spec = _one("Deployment", "tandem-openai")["spec"]["template"]["spec"]
    [container] = spec["containers"]
    up = UpConfig(
        IMAGE_MODEL_DIR,
        "0.0.0.0",
        PORTS["encoder"],
        PORTS["decoder"],
        dtype=None,
        world_size=None,
        openai_port=OPENAI_PORT,
    )
    expected = serve_command("openai", up)
    for service in ("decoder", "encoder"):
        name = _one("Service", f"tandem-{service}")["metadata"]["name"]
        [port] = _one("Service", f"tandem-{service}")["spec"]["ports"]
        flag = expected.index(f"--{service}-address") + 1
        assert expected[flag] == f"127.0.0.1:{port['port']}"
        expected[flag] = f"dns:///{name}:{port['port']}"
    assert container["command"] == ["tandem", *expected]
    assert container["ports"] == [{"name": "http", "containerPort": OPENAI_PORT}]
    assert spec["terminationGracePeriodSeconds"] == DEFAULT_GRACE_S + STOP_MARGIN_S
    resources = container["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]
    assert "volumes" not in spec and "initContainers" not in spec  # it holds no model


def test_the_gateway_is_ready_on_http_health_and_alive_while_it_answers_at_all() -> None:
    """/health is 503 while the decoder is down: the gateway leaves the Service then, but is not
    restarted for it (liveness is a TCP connect to its own port)."""
    [container] = _one("Deployment", "tandem-openai")["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["tcpSocket"] == {"port": "http"}


def test_the_gateways_service_spreads_http_connections_over_its_ready_pods() -> None:
    spec = _one("Service", "tandem-openai")["spec"]
    template = _one("Deployment", "tandem-openai")["spec"]["template"]
    assert spec.get("clusterIP") != "None"  # kube-proxy balances HTTP connections; no gRPC client here
    assert spec["selector"].items() <= template["metadata"]["labels"].items()
    assert spec["ports"] == [
        {"name": "http", "port": OPENAI_PORT, "targetPort": "http", "appProtocol": "http"}
    ]
