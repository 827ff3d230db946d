"""`tandem chat --image` and `tandem generate --part image:FILE` against the split LLaVA: the picture
goes to the encoder, its rows to the decoder, and the answer is the Python client's."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

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
    assert code == 1 and err.startswith("tandem generate: --part:") and "none.png" in err
