"""The encoder's half of a LLaVA or SmolVLM checkpoint: images and text into the decoder's space.

Loads the vision tower and its projector (or connector), and the language model's token table for
text, token IDs and the markers around an image's tiles; never the language model's layers, which
are the decoder's. Images are embedded in batches: every tile of every image in a batch goes through
the tower in one forward pass (`embed_images`); then each image's span is assembled, the tower's
rows where its image tokens are and the token table's rows everywhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from tokenizers import Tokenizer

from tandem.common import vision_language
from tandem.encoder.embedder import EmbedderInfo, EmbedderLoadError, Pooling
from tandem.encoder.lookup import (
    LookupEmbedder,
    as_decoder_has_it,
    check_table_shape,
    check_tokenizer_fits,
    language_model_table,
    read_json,
    read_tokenizer,
)
from tandem.encoder.vision.image_span import PreparedImage, VisionModel
from tandem.encoder.vision.llava import LlavaVision
from tandem.encoder.vision.placeholder import image_placeholder
from tandem.encoder.vision.weights import read_weights


def processor_config(model_dir: Path) -> dict[str, Any]:
    """The image processor's settings: preprocessor_config.json, or processor_config.json's
    `image_processor` (where transformers 5 writes them)."""
    path = model_dir / "preprocessor_config.json"
    if path.is_file():
        return read_json(path)
    processor = model_dir / "processor_config.json"
    if processor.is_file() and isinstance(read_json(processor).get("image_processor"), dict):
        return read_json(processor)["image_processor"]
    raise EmbedderLoadError(f"preprocessor_config.json not found in {model_dir}")


class VisionLanguageEmbedder:
    """Text and token IDs by the token table (as LookupEmbedder); images by the vision model."""

    def __init__(self, lookup: LookupEmbedder, vision: VisionModel, placeholder: str) -> None:
        self.lookup = lookup
        self.vision = vision
        self._info = EmbedderInfo(
            kind="vision",
            hidden_size=lookup.info.hidden_size,
            vocab_size=lookup.info.vocab_size,
            dtype=lookup.info.dtype,
            max_token_chars=lookup.info.max_token_chars,
            image_placeholder=placeholder,
        )

    @classmethod
    def load(
        cls,
        model_dir: Path,
        dtype: torch.dtype,
        quantization: str = "none",
        tokenizer: Tokenizer | None = None,
    ) -> VisionLanguageEmbedder:
        """`quantization`: the decoder's int8 / int4, whose rounding of the token table the text rows
        follow (as LookupEmbedder's do); the tower and projector are never rounded. `tokenizer`:
        model_dir's, already parsed (the __main__ parses it before listening), else read here."""
        hf_config = read_json(model_dir / "config.json")
        architecture = (hf_config.get("architectures") or [""])[0]
        language_model = language_model_table(model_dir, hf_config)
        files, table_name = language_model.files, language_model.name
        hidden_size = language_model.shape.hidden_size
        check_table_shape(model_dir)  # as the __main__ did before listening: the files may have changed
        table = read_weights(files, [table_name])[table_name]  # [vocab_size, hidden_size]
        if tokenizer is None:
            tokenizer = read_tokenizer(model_dir)
        check_tokenizer_fits(tokenizer, language_model.shape.vocab_size, model_dir, is_vision_language=True)
        image_token_id, placeholder = image_placeholder(model_dir, hf_config, tokenizer)
        processing = processor_config(model_dir)
        vision: VisionModel
        if architecture == vision_language.LLAVA:
            vision = LlavaVision.load(
                hf_config, processing, files, hidden_size, image_token_id, dtype, EmbedderLoadError
            )
        else:
            from tandem.encoder.vision.idefics3 import Idefics3Vision

            vision = Idefics3Vision.load(
                hf_config, processing, files, tokenizer, image_token_id, dtype, EmbedderLoadError
            )
        table = as_decoder_has_it(table, dtype, quantization, table_name)
        return cls(LookupEmbedder(table, tokenizer, kind="vision"), vision, placeholder)

    @property
    def info(self) -> EmbedderInfo:
        return self._info

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.lookup.tokenize(text, add_special_tokens)

    def embed(self, token_ids: list[int], pooling: Pooling) -> torch.Tensor:
        return self.lookup.embed(token_ids, pooling)

    def embed_into(self, token_ids: list[int], out: torch.Tensor) -> None:
        self.lookup.embed_into(token_ids, out)  # out: [len(token_ids), hidden_size]

    def describe(self) -> str:
        """The image half it loaded, for the log (VisionModel.describe)."""
        return self.vision.describe()

    def image_span_size(self, width: int, height: int) -> int:
        """The span's length for a picture of this size, from its header (VisionModel.span_size)."""
        return self.vision.span_size(width, height)

    def image_prepared_pixels(self, width: int, height: int) -> int:
        """The pixels the processor's preparation makes of a picture of this size, its resizes' and its
        tiles' (VisionModel.prepared_pixels), for the batcher to weigh its call."""
        return self.vision.prepared_pixels(width, height)

    def prepare_image(self, image: Image.Image) -> PreparedImage:
        """Preprocessed tiles and the span's token IDs (the servicer checks the span's size)."""
        return self.vision.prepare(image)

    @torch.inference_mode()
    def embed_images(self, images: Sequence[PreparedImage]) -> list[torch.Tensor]:
        """Each image's span rows, [len(span), hidden_size]; all tiles through the tower at once."""
        pixels = torch.cat([image.pixels for image in images])  # [tiles, 3, side, side]
        features = self.vision.encode(pixels).to(self.info.dtype)  # [tiles, rows per tile, hidden]
        flat = features.reshape(-1, features.shape[-1])
        spans, start = [], 0
        for image in images:
            ids = torch.tensor(image.token_ids, dtype=torch.long)
            at_image = (ids == self.vision.image_token_id).nonzero().squeeze(1)  # [image tokens]
            # index_select and index_copy_, not advanced indexing and a mask: the same rows, 1.6 ms
            # against 1.0 for a 576-row LLaVA-1.5 span on one thread (0.8-24 against 0.45-8.5 on two).
            rows = self.lookup.rows(image.token_ids)  # markers' rows; image tokens' are overwritten
            count = len(at_image)
            rows.index_copy_(0, at_image, flat[start : start + count])
            start += count
            spans.append(rows)
        return spans
