"""The torch-free Python client (clients/python): installed into a clean venv, against a live decoder."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tandem.decoder.models.loader import LoadedModel
from tests.integration.decoder.conftest import serve, shutdown
from tests.integration.package_index import install
from tests.layout import REPO_ROOT, package_dir

CLIENT_PROJECT = REPO_ROOT / "clients" / "python"

# Runs in the clean venv: nothing of the server's stack may be importable there.
CLIENT_SCRIPT = """
import asyncio, importlib.util, json, sys

from tandem_client.client import DecoderClient

async def main(address):
    async with DecoderClient(address) as client:
        await client.wait_serving(timeout=30)
        info = await client.model_info()
        text, finished = await client.generate_text(["Once upon a time"], max_new_tokens=5, temperature=0.0)
        tokens = await client.tokenize(["Once upon a time"])
    missing = [m for m in ("torch", "numpy", "opentelemetry") if importlib.util.find_spec(m) is None]
    has_tensors = importlib.util.find_spec("tandem") is not None  # the server package: absent
    print(json.dumps({
        "hidden_size": info.hidden_size, "text": text, "output_tokens": finished.usage.output_tokens,
        "tokens": tokens, "missing": missing, "has_tensors": has_tensors,
    }))

asyncio.run(main(sys.argv[1]))
"""


def _requirements(pyproject: Path) -> dict[str, str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    return {req.split(">")[0].split("=")[0].split("<")[0]: req for req in project["dependencies"]}


def test_the_client_requires_what_the_project_requires() -> None:
    client, project = (
        _requirements(CLIENT_PROJECT / "pyproject.toml"),
        _requirements(REPO_ROOT / "pyproject.toml"),
    )
    assert {name: project.get(name) for name in client} == client


@pytest.fixture(scope="module")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only tandem-client installed, built from a copy of the sources it needs."""
    root = tmp_path_factory.mktemp("python-client")
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    client = package_dir("tandem.client")
    shutil.copytree(client, root / client.relative_to(REPO_ROOT), ignore=ignore)
    shutil.copytree(CLIENT_PROJECT, root / "clients" / "python", ignore=ignore)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    # A packaging fault fails this (it was a skip, which hid one); an index out of reach skips it.
    install([str(python), "-m", "pip", "install", "--quiet", str(root / "clients" / "python")])
    return python


async def test_a_clean_venv_client_streams_from_a_live_decoder(
    client_python: Path, tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    served = await serve(tiny_model_dir, tiny_fp32)
    try:
        process = await asyncio.create_subprocess_exec(
            str(client_python),
            "-c",
            CLIENT_SCRIPT,
            served.server.address,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=client_python.parent,  # not the repository: only the installed client is importable
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
        assert process.returncode == 0, stderr.decode()
        seen = json.loads(stdout)
        reference, finished = await served.client.generate_text(
            ["Once upon a time"], max_new_tokens=5, temperature=0.0
        )
    finally:
        await shutdown(served)
    assert seen["missing"] == ["torch", "numpy", "opentelemetry"] and not seen["has_tensors"]
    assert seen["hidden_size"] == tiny_fp32.config.hidden_size
    assert (seen["text"], seen["output_tokens"]) == (reference, finished.usage.output_tokens)
    assert seen["tokens"] == [tiny_fp32.tokenizer.encode("Once upon a time", add_special_tokens=False).ids]
