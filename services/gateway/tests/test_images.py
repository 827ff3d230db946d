"""A chat's pictures and its `n` choices: each distinct picture of a request is embedded once, whichever
service fetches its rows (the gateway through its encoder, or a decoder with an encoder of its own),
and every choice answers as the same body with n = 1 and seed + j does. The services are the tests'
fakes: the encoder keeps every picture it embeds, the decoder's answer spells each picture's rows."""

from __future__ import annotations

import base64
import json
from typing import Any

import aiohttp
import pytest

from tandem.client.errors import InvalidArgument
from tandem.gateway.images import image_file

from .fake_decoder import fake_decoder
from .fake_encoder import fake_encoder, rows_of
from .live_gateway import live_gateway

PICTURE_A, PICTURE_B = b"\x89PNG picture A", b"\xff\xd8 picture B"


def _image(picture: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(picture).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _shown(picture: bytes) -> str:
    """How the fake decoder's answer spells a picture's rows."""
    return f"[image {rows_of(picture)[:4].hex()}]"


async def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        answer = json.loads(await response.text())
        assert response.status == 200, answer
        return answer


def _texts(answer: dict[str, Any]) -> list[str]:
    return [choice["message"]["content"] for choice in answer["choices"]]


TWO_PICTURES = {
    "messages": [
        {"role": "user", "content": [_image(PICTURE_A), {"type": "text", "text": "and"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "this"}, _image(PICTURE_B)]},
    ],
    "seed": 7,
}


@pytest.mark.parametrize("decoder_fetches", [False, True], ids=["gateway embeds", "decoder fetches"])
async def test_n_choices_of_a_chat_with_pictures_embed_each_picture_once(decoder_fetches: bool) -> None:
    async with (
        fake_encoder() as (encoder, encoder_address),
        fake_decoder(encoder_address if decoder_fetches else None) as (decoder, decoder_address),
        live_gateway(decoder_address, encoder_address=encoder_address) as url,
    ):
        answer = await _post(f"{url}/chat/completions", TWO_PICTURES | {"n": 3})
        assert sorted(encoder.embedded) == sorted([PICTURE_A, PICTURE_B])  # not once per choice
        alone = []
        for j in range(3):
            decoder.cached_rows.clear()  # each request as the first with its pictures
            embedded = len(encoder.embedded)
            alone += _texts(await _post(f"{url}/chat/completions", TWO_PICTURES | {"seed": 7 + j}))
            assert len(encoder.embedded) == embedded + 2
    prompt = f"{_shown(PICTURE_A)}andokthis{_shown(PICTURE_B)}"
    assert _texts(answer) == alone == [f"<{prompt}> seed={7 + j}" for j in range(3)]
    assert len(decoder.requests) == 6  # the choices are still a Generate call each


async def test_a_picture_repeated_in_a_chat_is_embedded_once_by_the_gateway() -> None:
    body = {
        "messages": [{"role": "user", "content": [_image(PICTURE_A), _image(PICTURE_B), _image(PICTURE_A)]}],
        "n": 2,
    }
    async with (
        fake_encoder() as (encoder, encoder_address),
        fake_decoder() as (_, decoder_address),
        live_gateway(decoder_address, encoder_address=encoder_address) as url,
    ):
        answer = await _post(f"{url}/chat/completions", body)
    assert sorted(encoder.embedded) == sorted([PICTURE_A, PICTURE_B])
    shown = f"{_shown(PICTURE_A)}{_shown(PICTURE_B)}{_shown(PICTURE_A)}"
    assert _texts(answer) == [f"<{shown}> seed=none"] * 2


@pytest.mark.parametrize(
    ("url", "refusal"),
    [
        (
            "data:text/plain;base64,iVBORw0K",
            "must be a picture (data:image/...;base64,...), got 'text/plain'",
        ),
        ("data:;base64,iVBORw0K", "got ''"),  # RFC 2397: no media type is text/plain
        ("data:image/png;base64,", "holds no picture: its base64 is empty"),
        ("data:image/png;base64,iVBORw0K!", "is not valid base64"),
        ("data:image/png,iVBORw0K", "must be base64"),
    ],
)
def test_an_image_url_that_is_no_picture_is_refused_naming_its_part(url: str, refusal: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        image_file({"type": "image_url", "image_url": {"url": url}}, "messages[0].content[1].image_url")
    assert error.value.field == "messages[0].content[1].image_url" and refusal in str(error.value)


def test_an_image_url_of_any_picture_type_is_its_file() -> None:
    for media_type in ("image/png", "IMAGE/JPEG", "image/webp;name=x.webp"):
        url = f"data:{media_type};base64," + base64.b64encode(PICTURE_A).decode()
        assert image_file({"type": "image_url", "image_url": {"url": url}}, "x") == PICTURE_A


@pytest.mark.parametrize(
    "head", ["DATA:image/png;base64,", "Data:image/png;BASE64,", "data:IMAGE/PNG;Base64,"]
)
def test_a_data_url_is_read_whatever_the_case_of_its_scheme_and_base64_token(head: str) -> None:
    # RFC 3986: a scheme is case-insensitive; RFC 2045/2397: so are the media type and its parameters.
    url = head + base64.b64encode(PICTURE_A).decode()
    assert image_file({"type": "image_url", "image_url": {"url": url}}, "x") == PICTURE_A


@pytest.mark.parametrize("detail", [5, "ultra", ""])
def test_an_image_urls_detail_is_one_of_openais_or_refused_naming_it(detail: object) -> None:
    # The encoder reads every picture at its own resolution, so `detail` changes nothing; one OpenAI
    # would refuse passed unread. "original" is the openai SDK's too (3.63 types auto|low|high|original),
    # which vLLM's message types take: it was refused.
    url = "data:image/png;base64," + base64.b64encode(PICTURE_A).decode()
    for given in ("auto", "low", "high", "original", None):
        assert image_file({"image_url": {"url": url, "detail": given}}, "x") == PICTURE_A
    with pytest.raises(InvalidArgument) as error:
        image_file({"image_url": {"url": url, "detail": detail}}, "messages[0].content[1].image_url")
    assert error.value.field == "messages[0].content[1].image_url.detail"
