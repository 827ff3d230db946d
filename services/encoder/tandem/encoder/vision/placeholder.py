"""The image placeholder of a vision-language checkpoint: the token config.json names for where an image
goes, as tokenizer.json writes it. Read from config.json and the parsed tokenizer alone, so the encoder
checks it before it listens as well as when it loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tandem.common import vision_language
from tandem.encoder.embedder import MAX_IMAGE_PLACEHOLDER_BYTES, EmbedderLoadError

TOKEN_ID_BOUND = 1 << 32  # the tokenizers library's IDs are u32


def image_placeholder(model_dir: Path, hf_config: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, str]:
    """The image token's ID (config.json's `image_token_index`) and its text in `tokenizer`. Raises
    EmbedderLoadError where tokenizer.json has no such token, or one over MAX_IMAGE_PLACEHOLDER_BYTES."""
    image_token_id = vision_language.image_token_id(hf_config)
    # The library's IDs are u32: one outside them (-1) raised OverflowError, a traceback at load.
    placeholder = None
    if image_token_id is not None and 0 <= image_token_id < TOKEN_ID_BOUND:
        placeholder = tokenizer.id_to_token(image_token_id)
    if image_token_id is None or placeholder is None:
        raise EmbedderLoadError(
            f"config.json in {model_dir}: image_token_index is not a token of tokenizer.json"
        )
    if len(placeholder.encode()) > MAX_IMAGE_PLACEHOLDER_BYTES:
        # Bounded at load rather than counted per reply in the rows' allowance: a placeholder this
        # long is the checkpoint's fault, found once here, where counted it would shrink every image's
        # allowance by a length no caller sees, and refuse images "the response would take ... bytes;
        # send a shorter input", blaming an input that fits. Uncounted, it would take replies near
        # --max-message-bytes past gRPC's cap: RESOURCE_EXHAUSTED from gRPC, naming no field.
        raise EmbedderLoadError(
            f"tokenizer.json in {model_dir}: the image placeholder, token {image_token_id} "
            f"(config.json's image_token_index), is {len(placeholder.encode())} bytes, over the "
            f"{MAX_IMAGE_PLACEHOLDER_BYTES} an image placeholder may take (every Embed reply of an "
            "image carries it)"
        )
    return image_token_id, placeholder
