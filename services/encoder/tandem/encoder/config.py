"""The encoder's configuration: one frozen object, validated when built, passed down.

Built once in `__main__` (from flags, or `TANDEM_ENCODER_*` environment variables for flags not
given) or directly by tests. Values that depend on the loaded model (the effective position limit,
the hidden size) are computed by the servicer and never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.client.errors import ConfigError
from tandem.common.dtypes import COMPUTE_NAMES
from tandem.common.model_name import check_served_name
from tandem.common.server import ServerOptions
from tandem.common.torch_part.quantized_tensor import SCHEMES
from tandem.common.torch_part.shared_memory import SHM_DIR
from tandem.common.torch_part.torch_dtypes import COMPUTE_DTYPES
from tandem.encoder.embedder import Pooling, path_refusal

EMBEDDERS = ("lookup", "soft-prompt", "projector")
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
# An Embed request's fields beside its input (request_id, model, the enums, a shared-memory offer, with
# their tags), and then some: an image of max_image_bytes travels in max_image_bytes plus this.
SMALL_FIELDS_BYTES = 64 * 1024
QUANTIZATIONS = ("none", *SCHEMES)
DEFAULT_PORT = 50051


@dataclass(frozen=True)
class EncoderConfig:
    """Everything the encoder service needs."""

    model_dir: Path  # the decoder checkpoint whose hidden space the embeddings live in.
    embedder: str = "lookup"  # one of EMBEDDERS.
    adapter_dir: Path | None = None  # soft-prompt: a PEFT prompt-tuning adapter directory.
    encoder_model_dir: Path | None = None  # projector: a Hugging Face encoder model (BERT family).
    projector_path: Path | None = None  # projector: safetensors weights, encoder hidden -> decoder hidden.
    pooling: Pooling = Pooling.NONE  # applied when a request leaves pooling UNSPECIFIED.
    dtype: str = "bfloat16"  # native dtype of the embeddings (the decoder's, for exact lookups).
    # The decoder's --quantization when it rounds a dense checkpoint ("int8", "int4"): the lookup table
    # is rounded as the decoder rounds its own (8-bit per row under either), so its rows stay the
    # decoder's embedding of the same tokens. A GGUF file's own weights need nothing: the imported
    # table already holds the file's values.
    quantization: str = "none"
    max_input_tokens: int = 8192  # most positions per Embed call (the embedder may allow fewer).
    # Images (a LLaVA or SmolVLM checkpoint): the bytes of one, and its pixels, read from its header
    # before it is decoded (PIL holds RGB in 4 bytes a pixel, and compositing an alpha channel onto
    # white takes a few copies: 32 Mpx is 128 MB to about 0.5 GB while it is preprocessed).
    # The bytes must travel in a request within server.max_message_bytes (else gRPC refuses the
    # message before the encoder sees it, naming no field): None is DEFAULT_MAX_IMAGE_BYTES, or what
    # such a request carries when that is less (`image_bytes_limit`); a value it cannot carry is refused.
    max_image_bytes: int | None = None
    max_image_pixels: int = 32 * 1024 * 1024
    # Concurrent Embed calls run together: at most this many, a batch led by an image waiting at most
    # this long for company (text never waits: a 2 ms wait took a lone text Embed on SmolLM2 from 0.73
    # to 2.9 ms, median of 200). Calls that arrive while a batch runs form the next one in any case.
    max_batch_size: int = 8
    max_batch_wait_ms: float = 2.0
    # Replies in shared memory for callers on this host (an Embed call's `shared_memory` offer, what a
    # decoder started with --encoder sends): a pool of at most this many bytes and segments, leased or
    # free (beyond them the reply carries bytes), each segment leased to one reply until its reader
    # releases it or the lease runs out. 0 bytes: never. The directory is /dev/shm; tests point it
    # elsewhere to be another host.
    shared_memory_bytes: int = 1024 * 1024 * 1024
    shared_memory_segments: int = 256
    shared_memory_lease_s: float = 10.0
    shared_memory_dir: Path = SHM_DIR
    server: ServerOptions = field(default_factory=lambda: ServerOptions(port=DEFAULT_PORT))
    model_name: str = ""  # reported by GetModelInfo and checked against requests; "" = directory name.

    def __post_init__(self) -> None:
        if self.embedder not in EMBEDDERS:
            raise ConfigError("embedder", f"must be one of {EMBEDDERS}, got {self.embedder!r}")
        if self.dtype not in COMPUTE_NAMES:
            raise ConfigError("dtype", f"must be one of {COMPUTE_NAMES}, got {self.dtype!r}")
        if not isinstance(self.pooling, Pooling):
            raise ConfigError("pooling", f"must be one of {[p.value for p in Pooling]}, got {self.pooling!r}")
        self._check_quantization()
        for name in (
            "max_input_tokens",
            "max_image_pixels",
            "max_batch_size",
            "shared_memory_segments",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        self._check_max_image_bytes()
        # Every Embed reply carries the name, within the room request.py keeps beside the rows.
        check_served_name(self.served_model_name)
        if self.shared_memory_bytes < 0:
            raise ConfigError(
                "shared_memory_bytes", f"must be >= 0 (0: never), got {self.shared_memory_bytes}"
            )
        if not 0.1 <= self.shared_memory_lease_s <= 3600:
            raise ConfigError(
                "shared_memory_lease_s", f"must be in [0.1, 3600] seconds, got {self.shared_memory_lease_s}"
            )
        if not 0 <= self.max_batch_wait_ms <= 1000:
            raise ConfigError("max_batch_wait_ms", f"must be in [0, 1000], got {self.max_batch_wait_ms}")
        # Each path belongs to one embedder: a path given to another one is a mistake, not a no-op.
        required = {
            "soft-prompt": ("adapter_dir",),
            "projector": ("encoder_model_dir", "projector_path"),
        }
        for kind, names in required.items():
            for name in names:
                is_set = getattr(self, name) is not None
                if self.embedder == kind and not is_set:
                    raise ConfigError(name, f"is required by embedder {kind!r}")
                if self.embedder != kind and is_set:
                    raise ConfigError(name, f"is only used by embedder {kind!r}, not {self.embedder!r}")

    def _check_max_image_bytes(self) -> None:
        if self.max_image_bytes is None:
            return
        if self.max_image_bytes < 1:
            raise ConfigError("max_image_bytes", f"must be >= 1, got {self.max_image_bytes}")
        max_message_bytes = self.server.max_message_bytes
        if self.max_image_bytes + SMALL_FIELDS_BYTES > max_message_bytes:
            raise ConfigError(
                "max_image_bytes",
                f"{self.max_image_bytes} cannot travel within --max-message-bytes {max_message_bytes} "
                f"(an Embed request carries up to {SMALL_FIELDS_BYTES} bytes of other fields): raise "
                f"--max-message-bytes to {self.max_image_bytes + SMALL_FIELDS_BYTES}"
                + (
                    f" or lower --max-image-bytes to {max_message_bytes - SMALL_FIELDS_BYTES}"
                    if max_message_bytes > SMALL_FIELDS_BYTES
                    else ""
                ),
            )

    def check_room_for_images(self) -> None:
        """For a checkpoint that takes images: a message has room for one beside the other fields.

        Not checked when built, since only the checkpoint says whether images are served: a text
        deployment may keep messages of 64 KiB or less, where the default bound would be 0 bytes and
        every image refused as too large. Raises ConfigError naming both flags."""
        if self.image_bytes_limit >= 1:
            return
        max_message_bytes = self.server.max_message_bytes
        default_fits = SMALL_FIELDS_BYTES + DEFAULT_MAX_IMAGE_BYTES
        raise ConfigError(
            "max_message_bytes",
            f"{max_message_bytes} leaves no room for an image (this checkpoint takes images, and an "
            f"Embed request carries up to {SMALL_FIELDS_BYTES} bytes of other fields beside one): raise "
            f"--max-message-bytes above {SMALL_FIELDS_BYTES}, to {default_fits} "
            f"for the default --max-image-bytes of {DEFAULT_MAX_IMAGE_BYTES}",
        )

    def check_embedder_paths(self) -> None:
        """The adapter, encoder model and projector the embedder will load exist, and are directories or
        a file as each must be. Not checked when built (a config names paths of another host, or of
        tests); checked at start before the port opens: the load found them missing only after the
        server listened (exit 1). Raises ConfigError naming the path's field."""
        for name, is_dir in (("adapter_dir", True), ("encoder_model_dir", True), ("projector_path", False)):
            path = getattr(self, name)
            if path is not None and (refusal := path_refusal(path, is_dir)) is not None:
                raise ConfigError(name, f": {refusal}")

    def _check_quantization(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError("quantization", f"must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization != "none" and self.embedder == "projector":
            raise ConfigError(
                "quantization", "rounds the decoder's lookup table: not used by embedder 'projector'"
            )

    @property
    def served_model_name(self) -> str:
        return self.model_name or self.model_dir.name

    @property
    def image_bytes_limit(self) -> int:
        """The most bytes of one image: max_image_bytes, or its default within max_message_bytes (0
        when the messages are too small to carry any image beside the other fields, which a checkpoint
        that takes images refuses at start: `check_room_for_images`)."""
        if self.max_image_bytes is not None:
            return self.max_image_bytes
        return max(0, min(DEFAULT_MAX_IMAGE_BYTES, self.server.max_message_bytes - SMALL_FIELDS_BYTES))

    @property
    def torch_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.dtype]
