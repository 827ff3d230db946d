"""A vision-language checkpoint's image placeholder: config.json's image token, as tokenizer.json writes
it, or one line naming both files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.encoder.tests.vision_checkpoints import IMAGE_TOKEN
from tandem.encoder.embedder import EmbedderLoadError
from tandem.encoder.lookup import read_tokenizer
from tandem.encoder.vision.placeholder import image_placeholder


def test_the_placeholder_is_the_token_config_json_names(tiny_llava: Path) -> None:
    hf_config = json.loads((tiny_llava / "config.json").read_text())
    token_id, placeholder = image_placeholder(tiny_llava, hf_config, read_tokenizer(tiny_llava))
    assert (token_id, placeholder) == (hf_config["image_token_index"], IMAGE_TOKEN)


@pytest.mark.parametrize("token_id", [-1, 1 << 40, 1 << 70, 10**6])
def test_an_image_token_that_is_no_id_of_the_tokenizer_is_a_load_error_naming_it(
    tiny_llava: Path, token_id: int
) -> None:
    """-1 and IDs past u32 raised the tokenizers library's OverflowError: a traceback."""
    hf_config = {**json.loads((tiny_llava / "config.json").read_text()), "image_token_index": token_id}
    with pytest.raises(EmbedderLoadError) as raised:
        image_placeholder(tiny_llava, hf_config, read_tokenizer(tiny_llava))
    assert str(raised.value) == (
        f"config.json in {tiny_llava}: image_token_index is not a token of tokenizer.json"
    )
