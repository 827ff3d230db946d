"""What the decoder checks before it listens, cheapest first: the config, the device, the port, the model
(a GGUF file is imported once), the checkpoint's files and whether the world size shards it, the
--encoder address and the --cpu-kernels build. No weight is read; each failure is a ConfigError naming
the field at fault (`tandem up` asks `check_fits` before it starts the decoder).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from tandem.client.addresses import channel_target
from tandem.client.errors import ConfigError
from tandem.common.listening import check_port_free
from tandem.common.torch_part.model_cache import is_gguf_file, resolve_model
from tandem.decoder.api.options import config_from_options
from tandem.decoder.backends.backend import check_available, resolve
from tandem.decoder.backends.cpu.kernel_choice import check_kernels
from tandem.decoder.backends.cpu.kernel_options import AUTO as AUTO_KERNELS
from tandem.decoder.backends.xla.host_pool import check_host_pool
from tandem.decoder.backends.xla.runtime import check_device_count
from tandem.decoder.config import DecoderConfig
from tandem.decoder.distributed.parallel import RankInfo
from tandem.decoder.distributed.worker import rank_info
from tandem.decoder.engine.admission.template_source import TemplateRefused, check_template
from tandem.decoder.engine.step.sizing import (
    check_sliding_window,
    max_model_len,
    num_kv_blocks,
    pool_refused,
    static_shapes,
)
from tandem.decoder.engine.step.xla_buckets import XlaBuckets
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.kv_pool import KvPoolUnallocated
from tandem.decoder.models.loader import ModelLoadError, check_checkpoint
from tandem.decoder.models.peft_adapter import AdapterError, read_adapter
from tandem.decoder.models.quantized import check_group
from tandem.decoder.models.quantized_shards import check_cuttable
from tandem.decoder.models.tensor_parallel import check_shardable

log = logging.getLogger("tandem.decoder")


def checked_config(values: dict[str, Any]) -> tuple[DecoderConfig, RankInfo | None]:
    """Everything that can be checked before listening, cheapest first. Raises ConfigError."""
    config = config_from_options(values)
    check_available(config.engine.device)
    rank = rank_info(config, os.environ)  # None: one rank, no process group
    if rank is None or rank.rank == 0:  # only rank 0 listens (under torchrun every rank starts here)
        check_port_free(config.server.host, config.server.port)
    model = Path(config.engine.model_dir)
    config = with_checkpoint_dir(config)
    check_model(config, 1 if rank is None else rank.world_size, gguf_file=None if model.is_dir() else model)
    if config.encoder_address:
        try:
            channel_target(config.encoder_address)
        except ValueError as error:
            raise ConfigError("encoder_address", f": {error}") from None
    check_cpu_kernels(config)
    return config, rank


def check_cpu_kernels(config: DecoderConfig) -> None:
    """A build named by --cpu-kernels runs on this CPU and loads (where it would be used). Raises
    ConfigError."""
    engine = config.engine
    uses_them = resolve(engine.device).has_cpu_executor and engine.native_kernels and not engine.compile
    if engine.cpu_kernels != AUTO_KERNELS and uses_them:
        check_kernels(engine.cpu_kernels)


def with_checkpoint_dir(config: DecoderConfig) -> DecoderConfig:
    """The config with --model resolved to a checkpoint directory (a GGUF file is imported once).

    Runs before the server starts and before other ranks spawn, so a bad file fails fast with one line
    and every rank reads the same directory. Raises ConfigError.
    """
    source = Path(config.engine.model_dir)
    try:
        model_dir = resolve_model(source, config.engine.dtype, say=log.info)
    except ValueError as error:  # ModelNotFound, GGUFImportError
        raise ConfigError("model_dir", f": {error}") from None
    quantized_from = None
    if config.engine.quantization == "gguf":
        if not is_gguf_file(source):
            raise ConfigError(
                "quantization", f"gguf needs --model to be a GGUF file, got the directory {source}"
            )
        quantized_from = source
    engine = dataclasses.replace(config.engine, model_dir=model_dir, quantized_from=quantized_from)
    return dataclasses.replace(config, engine=engine)


def check_model(config: DecoderConfig, world_size: int, gguf_file: Path | None = None) -> None:
    """The checkpoint has what loading needs and `world_size` shards it; no weight is read.
    `gguf_file`: the file --model named, which `config`'s model_dir was imported from."""
    engine = config.engine
    model_config = check_fits(
        engine.model_dir,
        engine.dtype,
        engine.quantization,
        engine.quantization_group_size,
        world_size,
        gguf_file=gguf_file,
    )
    check_sliding_window(engine, model_config)  # a window narrower than --max-model-len is refused
    num_blocks = num_kv_blocks(engine, model_config, world_size)  # past what a pool may address
    is_xla = resolve(engine.device).placement == "xla"
    if is_xla:
        check_device_count(engine.num_devices)  # the user's CPU_NUM_DEVICES, another count
        try:  # the pool's copies on XLA's CPU device, past the host's memory
            check_host_pool(model_config, num_blocks, engine.block_size, engine.num_devices, os.environ)
        except KvPoolUnallocated as error:
            raise pool_refused(engine, error) from None
    # The buckets the engine will build, for the context it will serve: too small, or past every step.
    context = max_model_len(engine, model_config, num_blocks)
    configured = max_model_len(engine, model_config)  # before the pool's cap: what widths may reach
    if is_xla:
        XlaBuckets.from_config(engine, context, engine.num_devices, configured)
    else:
        static_shapes(engine, context, configured)
    for name, path in engine.loras:  # read once here too, so a bad adapter fails before listening
        try:
            read_adapter(path, model_config, engine.max_lora_rank)
        except AdapterError as error:
            raise ConfigError("loras", f": adapter {name!r}: {error}") from None


def check_fits(
    model_dir: str | Path,
    dtype: str,
    quantization: str,
    quantization_group_size: int,
    world_size: int,
    gguf_file: Path | None = None,
) -> ModelConfig:
    """The checkpoint in `model_dir` loads in `dtype`, its chat template compiles, `quantization`
    rounds it and `world_size` shards it; no weight is read (`tandem up` asks before it starts the
    decoder). `gguf_file`: the GGUF file `model_dir` was imported from, which a refusal of its
    template names (its `tokenizer.chat_template`) rather than the import's copy in the model cache.
    Returns the model's config; raises ConfigError naming the field at fault."""
    try:
        model_config = check_checkpoint(model_dir, dtype)
        # In a template worker: compiling runs some of the template.
        check_template(Path(model_dir), gguf_file=gguf_file)
    except (ModelLoadError, TemplateRefused) as error:
        raise ConfigError("model_dir", f": {error}") from None
    if quantization != "none":
        try:
            check_group(model_config, quantization_group_size)
        except ValueError as error:
            field = "quantization_group_size" if quantization == "int4" else "quantization"
            raise ConfigError(field, f"{quantization} cannot quantize this checkpoint: {error}") from None
    if world_size > 1:
        try:
            check_shardable(model_config, world_size)
        except ValueError as error:
            raise ConfigError("world_size", f": {error}") from None
        if quantization != "none":
            try:
                check_cuttable(model_config, world_size)
            except ValueError as error:
                raise ConfigError(
                    "world_size", f": {quantization} weights cannot be sharded: {error}"
                ) from None
    return model_config
