"""The README's and API.md's examples, run as a newcomer runs them, on the default model.

The README's blocks run top to bottom in one fresh shell (`bash` with job control, so its `kill %1`
works): `tandem up &`, `tandem wait`, `tandem generate`, the Python client, the gateway and the
OpenAI SDK. The only changes are the ports (free ones instead of 50051, 50052 and 8000, the defaults
written out where a command leaves them implicit) and the venv's path. API.md's Node.js commands then
run against the same kind of services, and each output the page shows is compared with what the
command prints today.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.tests.ports import free_port
from tests.integration.package_index import npm_ci

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
NODE_CLIENT = REPO_ROOT / "clients" / "node"


@dataclass(frozen=True)
class Ports:
    encoder: int
    decoder: int
    openai: int

    def apply(self, text: str) -> str:
        """`text` (a block of the docs) on these ports and this checkout's venv."""
        text = text.replace(".venv/bin/", f"{VENV_BIN}/")
        text = text.replace(
            "tandem up &", f"tandem up --encoder-port {self.encoder} --decoder-port {self.decoder} &"
        )
        # Commands that leave the services' addresses to their defaults (50052, 50051) name these ports.
        addresses = f"127.0.0.1:{self.decoder} --encoder-address 127.0.0.1:{self.encoder} "
        text = text.replace("tandem generate ", f"tandem generate --address {addresses}")
        text = text.replace("tandem serve openai ", f"tandem serve openai --decoder-address {addresses}")
        text = re.sub(
            r"tandem wait(?=\s+#|\s*$)",
            f"tandem wait 127.0.0.1:{self.encoder} 127.0.0.1:{self.decoder}",
            text,
            flags=re.M,
        )
        text = text.replace("127.0.0.1:50051", f"127.0.0.1:{self.encoder}").replace(
            ":50051", f":{self.encoder}"
        )
        text = text.replace("127.0.0.1:50052", f"127.0.0.1:{self.decoder}").replace(
            ":50052", f":{self.decoder}"
        )
        return text.replace("127.0.0.1:8000", f"127.0.0.1:{self.openai}").replace(
            "--port 8000", f"--port {self.openai}"
        )


def code_block(markdown: str, after: str, language: str) -> str:
    """The first ```language block after the line `after`."""
    rest = markdown[markdown.index(after) :]
    start = rest.index(f"```{language}\n") + len(language) + 4
    return rest[start : rest.index("```", start)]


def test_the_readmes_blocks_run_top_to_bottom_in_a_fresh_shell(tmp_path: Path) -> None:
    ports = Ports(free_port(), free_port(), free_port())
    readme = (REPO_ROOT / "README.md").read_text()
    mixed = code_block(readme, "## A mixed prompt", "sh")
    python = code_block(readme, "## A mixed prompt", "python")
    openai = code_block(readme, "### Your OpenAI client", "sh")
    script = "\n".join(
        [
            "set -m -e",  # job control, as in a terminal: `kill %1` names `tandem up &`
            ports.apply(mixed),
            f"{VENV_BIN}/python - <<'PYTHON'\n{ports.apply(python)}PYTHON",
            ports.apply(openai),
            "wait",  # the jobs `kill %2 %1` stopped, gone before the shell ends
        ]
    )
    (tmp_path / "readme.sh").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "OTEL_"))}
    process = subprocess.Popen(
        ["bash", str(tmp_path / "readme.sh")],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 0, output
    lines = output.splitlines()
    said = [line for line in lines if not line.startswith("[")]  # the commands', not the services' logs
    assert said.count(f"serving: 127.0.0.1:{ports.encoder}, 127.0.0.1:{ports.decoder}") == 1, output
    assert said.count(f"serving: http://127.0.0.1:{ports.openai}/health") == 1, output
    # `tandem generate` samples at temperature 1 with a random seed, so the model may end its answer
    # (EOS) before the 32 tokens the command asks for: either way one summary line, at most 32 tokens.
    summaries = [
        re.fullmatch(r"\[FINISH_REASON_(LENGTH|EOS); (\d+) tokens; ttft \d+\.\d+s\]", line) for line in lines
    ]
    finished = [m for m in summaries if m]
    assert len(finished) == 1, output
    reason, tokens = finished[0].group(1), int(finished[0].group(2))
    assert tokens == 32 if reason == "LENGTH" else 1 <= tokens < 32, output
    assert sum(line.startswith("[up] ready: ") for line in lines) == 1, output
    # The generated text, the Python client's and the OpenAI SDK's answer: one line each at least.
    assert len([line for line in said if line.strip() and not line.startswith("serving:")]) >= 3, output
    assert "Traceback" not in output, output


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    """`tandem up` on the default model, on ports of its own, until the module ends."""
    ports = Ports(free_port(), free_port(), free_port())
    log = tmp_path_factory.mktemp("up") / "up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "OTEL_"))}
    argv = [
        f"{VENV_BIN}/tandem",
        "up",
        "--encoder-port",
        str(ports.encoder),
        "--decoder-port",
        str(ports.decoder),
    ]
    with log.open("w") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        waited = subprocess.run(
            [f"{VENV_BIN}/tandem", "wait", f"127.0.0.1:{ports.encoder}", f"127.0.0.1:{ports.decoder}"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert waited.returncode == 0, waited.stderr + log.read_text()
        yield ports
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


@dataclass(frozen=True)
class Shown:
    """A command of the docs and the output lines they show for it."""

    argv: list[str]
    stdout: str | None  # the last stdout line, as shown (`...` stands for what varies)
    stderr: str | None


def node_examples(api: str) -> list[Shown]:
    """API.md's Node.js commands that show their output."""
    section = api[api.index("### Node.js (`clients/node`)") :]
    section = section[: section.index("\n### ", 1)]
    block = "\n".join(re.findall(r"```sh\n(.*?)```", section, flags=re.S))
    shown: list[Shown] = []
    command, out, err = None, None, None
    for line in [*block.splitlines(), "node end"]:
        if line.startswith("node "):
            if command is not None and (out or err):
                shown.append(Shown(command, out, err))
            command, out, err = shlex.split(line, comments=True), None, None
        elif line.startswith("# stderr: "):
            err = line.removeprefix("# stderr: ")
        elif line.startswith("# {"):
            out = line.removeprefix("# ")
    return shown


def _matches(shown: str, printed: str) -> bool:
    """`printed` (one JSON line) has every key `shown` names, with the value it shows; `...` and
    `[...]` stand for what varies."""
    expected = json.loads(shown.replace("[...]", "null").replace(",...}", "}"))
    got = json.loads(printed)
    return all(key in got and (value is None or got[key] == value) for key, value in expected.items())


def test_api_mds_node_outputs_are_what_the_client_prints(services: Ports) -> None:
    npm_ci(NODE_CLIENT)
    examples = node_examples((REPO_ROOT / "docs" / "API.md").read_text())
    assert len(examples) >= 3  # prompt tokens, the embedding's shape, the width error
    for example in examples:
        argv = [services.apply(arg) for arg in example.argv]
        result = subprocess.run(argv, cwd=NODE_CLIENT, capture_output=True, text=True, timeout=120)
        if example.stderr is not None:
            assert result.returncode == 1 and result.stderr.strip() == example.stderr, (argv, result.stderr)
        if example.stdout is not None:
            assert result.returncode == 0, (argv, result.stderr)
            last = result.stdout.strip().splitlines()[-1]
            assert _matches(example.stdout, last), (argv, example.stdout, last)
