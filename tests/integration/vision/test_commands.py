"""`tandem chat --image`, `tandem generate --part image:FILE` and the Node client's `chat.js --image`
against the split LLaVA: the picture goes to the encoder, its rows to the decoder, and the answer is
the Python client's."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.common.torch_part import tensors
from tandem.embedding_files import read_embeddings
from tests.integration.package_index import npm_ci
from tests.integration.vision.conftest import Split

REPO_ROOT = Path(__file__).resolve().parents[3]
QUESTION = "What is in the picture?"


async def _run(*args: str, stdin: bytes = b"") -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tandem.cli",
        *args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
    )
    out, err = await asyncio.wait_for(process.communicate(stdin), timeout=120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_tandem_chat_with_an_image_answers_as_the_client_does(
    split: Split, pictures: dict[str, Path]
) -> None:
    picture = pictures["landscape.png"]
    image = await split.images.embed_image(picture.read_bytes())
    expected, _ = await split.decoder.client.chat_text(
        [{"role": "user", "content": [image, QUESTION]}], max_new_tokens=12, temperature=0
    )
    code, out, err = await _run(
        "chat",
        "--address",
        split.decoder.server.address,
        "--encoder-address",
        split.encoder.server.address,
        "--image",
        str(picture),
        "--max-tokens",
        "12",
        stdin=f"{QUESTION}\n".encode(),
    )
    assert code == 0, err
    assert out.splitlines()[0] == f"assistant> {expected}"


async def test_tandem_generate_puts_an_image_part_where_it_is_given(
    split: Split, pictures: dict[str, Path]
) -> None:
    picture = pictures["portrait.jpg"]
    image = await split.images.embed_image(picture.read_bytes())
    expected, _ = await split.decoder.client.chat_text(
        [{"role": "user", "content": [image, QUESTION]}], max_new_tokens=12, temperature=0
    )
    code, out, err = await _run(
        "generate",
        "--address",
        split.decoder.server.address,
        "--encoder-address",
        split.encoder.server.address,
        "--prompt",
        "USER: ",
        "--part",
        f"image:{picture}",
        "--part",
        f"text:\n{QUESTION} ASSISTANT:",  # llava-1.5's template, written out
        "--max-tokens",
        "12",
        "--temperature",
        "0",
    )
    assert code == 0, err
    assert out.startswith(expected), (out, expected)


async def test_a_missing_image_file_is_one_line_naming_the_part(split: Split, tmp_path: Path) -> None:
    code, _, err = await _run(
        "generate", "--address", split.decoder.server.address, "--part", f"image:{tmp_path / 'none.png'}"
    )
    assert (
        code == 2
        and err == f"tandem generate: --part image:{tmp_path / 'none.png'}: No such file or directory\n"
    )


async def test_tandem_embed_image_writes_the_rows_embed_image_returns(
    split: Split, pictures: dict[str, Path], tmp_path: Path
) -> None:
    picture = pictures["portrait.jpg"]
    expected = tensors.decode((await split.images.embed_image(picture.read_bytes())).rows, "rows")
    address = split.encoder.server.address
    for name in ("rows.safetensors", "rows.npy"):
        code, out, err = await _run(
            "embed", "--address", address, "--image", str(picture), "--out", str(tmp_path / name)
        )
        assert code == 0, err
        assert out.strip() == f"wrote {tmp_path / name}: embeddings {list(expected.shape)} float32"
        assert torch.equal(read_embeddings(tmp_path / name), expected)
    span = load_file(tmp_path / "rows.safetensors")["token_ids"].tolist()
    assert span == [split.encoder.servicer._embedder.vision.image_token_id] * expected.shape[0]  # type: ignore[union-attr]
    code, out, err = await _run("embed", "--address", address, "--image", str(picture))
    assert code == 0, err
    assert out.splitlines()[0] == (
        f"embeddings {list(expected.shape)} float32 from an image's span of {expected.shape[0]} tokens "
        "(it replaces <image>)"
    )


async def test_tandem_embed_image_of_a_missing_file_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    code, out, err = await _run("embed", "--image", str(tmp_path / "none.png"))
    assert code == 2 and out == ""
    assert err.startswith("tandem embed: --image (TANDEM_EMBED_IMAGE): ") and "none.png" in err
    assert len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def node_chat() -> Path:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("npm/node are not installed: the Node.js client cannot be tested")
    node_client = REPO_ROOT / "clients" / "node"
    npm_ci(node_client)
    return node_client / "chat.js"


async def test_the_node_client_chats_with_an_image_as_the_python_client_does(
    split: Split, pictures: dict[str, Path], node_chat: Path
) -> None:
    picture = pictures["square.webp"]
    image = await split.images.embed_image(picture.read_bytes())
    expected, _ = await split.decoder.client.chat_text(
        [{"role": "user", "content": [image, QUESTION]}], max_new_tokens=10, temperature=0
    )
    process = await asyncio.create_subprocess_exec(
        "node",
        str(node_chat),
        split.decoder.server.address,
        QUESTION,
        "--image",
        str(picture),
        "--encoder",
        split.encoder.server.address,
        "--max-tokens",
        "10",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, err.decode()
    text, _, summary = out.decode().rstrip("\n").rpartition("\n")
    assert text == expected and json.loads(summary)["output_tokens"] == 10
