"""The gateway as a unit of its own: common/ and services/gateway/ installed alone into a fresh venv
(`pip install -e ./common -e ./services/gateway`, neither torch nor numpy there) serve a completion
from a live decoder, the same text the decoder's own client gets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tandem.decoder.models.loader import LoadedModel
from tests.integration.decoder.conftest import serve, shutdown
from tests.integration.gateway.conftest import gateway_process
from tests.integration.package_index import install
from tests.layout import REPO_ROOT

PROMPT, MAX_TOKENS = "Once upon a time", 5
# Which of torch and numpy the fresh venv lacks (it must lack both).
_MISSING = "import importlib.util as u; print(*(m for m in ('torch', 'numpy') if u.find_spec(m) is None))"


@pytest.fixture(scope="module")
def gateway_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("gateway-unit") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    common, gateway = REPO_ROOT / "common", REPO_ROOT / "services" / "gateway"
    install([str(python), "-m", "pip", "install", "--quiet", "-e", str(common), "-e", str(gateway)])
    return python


async def test_common_and_the_gateway_alone_serve_a_completion_without_torch(
    gateway_python: Path, tmp_path: Path, tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    missing = subprocess.run(
        [str(gateway_python), "-c", _MISSING], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout.split()
    assert missing == ["torch", "numpy"]
    served = await serve(tiny_model_dir, tiny_fp32)
    try:
        flags = ("--decoder-address", served.server.address)
        async with (
            gateway_process(tmp_path / "gateway.log", *flags, python=gateway_python) as gateway,
            aiohttp.ClientSession() as session,
        ):
            async with session.get(f"{gateway.url}/v1/models") as response:
                model = (await response.json())["data"][0]["id"]
            body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
            async with session.post(f"{gateway.url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                answer = await response.json()
            loaded = gateway.mapped_packages("torch", "numpy")
        reference, _ = await served.client.generate_text([PROMPT], max_new_tokens=MAX_TOKENS, temperature=0.0)
    finally:
        await shutdown(served)
    assert answer["choices"][0]["text"] == reference
    assert loaded == set()
