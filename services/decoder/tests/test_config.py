"""EngineConfig and DecoderConfig: a value out of range is refused when built, naming its field and its
limit, and the limit itself is taken (the command line says the same with the flag: api/ tests)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.common.dtypes import COMPUTE_NAMES
from tandem.decoder.backends import backend as backends
from tandem.decoder.config import (
    MAX_COLLECTIVE_TIMEOUT_S,
    MAX_SPECULATIVE_TOKENS,
    QUANTIZATIONS,
    QUANTIZED_ACTIVATIONS,
    DecoderConfig,
    EngineConfig,
)

MODEL = Path("/models/tiny")  # never read: a config names its model, the engine loads it
# The one device a number of devices other than 1 is taken on (SPMD): it runs only compiled static shapes.
NEURON = {"device": "neuron", "static_shapes": True, "compile": True}


def _refusal(build: Callable[..., object], **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as refused:
        build(**kwargs)
    return refused.value


def _engine(**kwargs) -> EngineConfig:
    return EngineConfig(model_dir=MODEL, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field", "reason"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs", "must be >= 1, got 0"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens", "must be >= 1, got 0"),
        ({"max_queue": 0}, "max_queue", "must be >= 1, got 0"),
        ({"block_size": 0}, "block_size", "must be >= 1, got 0"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes", "must be >= 1, got 0"),
        ({**NEURON, "num_devices": 0}, "num_devices", "must be >= 1, got 0"),
        ({"max_model_len": 1}, "max_model_len", "must be >= 2, got 1"),
        ({"num_kv_blocks": 1}, "num_kv_blocks", "must be >= 2 (block 0 is reserved), got 1"),
        ({"speculative_tokens": -1}, "speculative_tokens", "must be in [0, 16], got -1"),
        ({"speculative_tokens": 17}, "speculative_tokens", "must be in [0, 16], got 17"),
        ({"shared_step_seqs": -1}, "shared_step_seqs", "must be >= 0 (0: off), got -1"),
        ({"speculative_max_batch": 0}, "speculative_max_batch", "must be >= 1, got 0"),
        ({"num_threads": 0}, "num_threads", "must be >= 1, got 0"),
        ({"num_threads": -1}, "num_threads", "must be >= 1, got -1"),
        ({"max_loras": 0}, "max_loras", "must be in [1, 256], got 0"),
        ({"max_loras": 257}, "max_loras", "must be in [1, 256], got 257"),
        ({"max_lora_rank": 0}, "max_lora_rank", "must be in [1, 512], got 0"),
        ({"max_lora_rank": 513}, "max_lora_rank", "must be in [1, 512], got 513"),
    ],
)
def test_an_engine_bound_past_its_limit_is_refused_naming_the_field_and_the_limit(
    kwargs: dict, field: str, reason: str
) -> None:
    refused = _refusal(_engine, **kwargs)
    assert (refused.field, refused.reason) == (field, reason)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 1, "max_num_batched_tokens": 1, "max_queue": 1, "kv_cache_bytes": 1},
        {"block_size": 1},  # the torch attention takes any size; other attentions refuse their own
        {**NEURON, "num_devices": 1},
        {"max_model_len": 2, "num_kv_blocks": 2},
        {"speculative_tokens": 0, "shared_step_seqs": 0, "speculative_max_batch": 1, "num_threads": 1},
        {"speculative_tokens": MAX_SPECULATIVE_TOKENS},
        {"max_loras": 1, "max_lora_rank": 1},
        {"max_loras": 256, "max_lora_rank": 512},
    ],
)
def test_each_engine_bound_at_its_limit_is_taken(kwargs: dict) -> None:
    config = _engine(**kwargs)
    assert {name: getattr(config, name) for name in kwargs} == kwargs


@pytest.mark.parametrize(
    ("kwargs", "field", "reason"),
    [
        ({"dtype": "int8"}, "dtype", f"must be one of {COMPUTE_NAMES}, got 'int8'"),
        ({"quantization": "q4_k"}, "quantization", f"must be one of {QUANTIZATIONS}, got 'q4_k'"),
        (
            {"quantized_activations": "int4"},
            "quantized_activations",
            f"must be one of {QUANTIZED_ACTIVATIONS}, got 'int4'",
        ),
        # The quantized linears are C kernels of eager steps: no bucket pads them.
        (
            {"quantization": "int8", "static_shapes": True},
            "quantization",
            "int8 needs --static-shapes off (eager steps only)",
        ),
    ],
)
def test_an_engine_choice_outside_its_choices_is_refused_naming_them(
    kwargs: dict, field: str, reason: str
) -> None:
    # The command line's own choices refuse the three names before the config does; a config built in
    # code (tests, the offline API) meets only this refusal.
    refused = _refusal(_engine, **kwargs)
    assert (refused.field, refused.reason) == (field, reason)


@pytest.mark.parametrize("name", ["token_buckets", "seq_buckets", "block_table_buckets"])
@pytest.mark.parametrize("buckets", [(4, 4), (8, 4), (0, 4), (-1,)])
def test_buckets_not_strictly_increasing_positive_sizes_are_refused_naming_them(
    name: str, buckets: tuple[int, ...]
) -> None:
    refused = _refusal(_engine, static_shapes=True, **{name: buckets})
    assert (refused.field, refused.reason) == (
        name,
        f"must be strictly increasing positive sizes, got {buckets}",
    )
    assert getattr(_engine(static_shapes=True, **{name: (1, 2)}), name) == (1, 2)  # the least size: 1


def test_more_adapters_than_slots_or_a_name_no_request_could_give_is_refused_naming_loras() -> None:
    two = (("a", MODEL / "a"), ("b", MODEL / "b"))
    refused = _refusal(_engine, enable_lora=True, max_loras=1, loras=two)
    assert (refused.field, refused.reason) == ("loras", ": 2 adapters, more than max_loras 1")
    assert _engine(enable_lora=True, max_loras=2, loras=two).loras == two  # as many as the slots
    refused = _refusal(_engine, enable_lora=True, loras=(("", MODEL / "a"),))
    assert (refused.field, refused.reason) == ("loras", ": adapter name '': must be 1 to 256 bytes, got 0")
    refused = _refusal(_engine, enable_lora=True, loras=(("a", MODEL / "a"), ("a", MODEL / "b")))
    assert (refused.field, refused.reason) == ("loras", ": adapter name 'a' is given twice")


def _decoder(**kwargs) -> DecoderConfig:
    return DecoderConfig(_engine(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field", "reason"),
    [
        ({"max_streams_per_connection": 0}, "max_streams_per_connection", "must be >= 1, got 0"),
        ({"max_streams_per_token": 0}, "max_streams_per_token", "must be >= 1, got 0"),
        ({"encoder_cache_bytes": -1}, "encoder_cache_bytes", "must be >= 0 (0: none), got -1"),
        ({"world_size": 0}, "world_size", "must be >= 1, got 0"),
        (
            {"collective_timeout_s": MAX_COLLECTIVE_TIMEOUT_S + 1},
            "collective_timeout_s",
            "must be > 0 and at most 86,400 (a day), got 86401.0",
        ),
        (
            {"encoder_address": "10.0.0.1:1,,10.0.0.2:1"},
            "encoder_address",
            "expected host:port, several separated by commas, got '10.0.0.1:1,,10.0.0.2:1'",
        ),
    ],
)
def test_a_serving_bound_past_its_limit_is_refused_naming_the_field_and_the_limit(
    kwargs: dict, field: str, reason: str
) -> None:
    refused = _refusal(_decoder, **kwargs)
    assert (refused.field, refused.reason) == (field, reason)


def test_each_serving_bound_at_its_limit_is_taken() -> None:
    least = {"max_streams_per_connection": 1, "max_streams_per_token": 1, "encoder_cache_bytes": 0}
    config = _decoder(**least, collective_timeout_s=MAX_COLLECTIVE_TIMEOUT_S)
    assert {name: getattr(config, name) for name in least} == least
    assert config.collective_timeout_s == MAX_COLLECTIVE_TIMEOUT_S


def test_an_adapter_named_as_the_model_is_refused_naming_loras() -> None:
    # A request naming it could mean either.
    engine = _engine(enable_lora=True, loras=(("tiny-chat", MODEL / "a"),))
    with pytest.raises(ConfigError) as refused:
        DecoderConfig(engine, model_name="tiny-chat")
    assert (refused.value.field, refused.value.reason) == (
        "loras",
        ": adapter name 'tiny-chat' is the model's own name",
    )
    assert DecoderConfig(engine, model_name="tiny").engine.loras == engine.loras


def test_several_ranks_on_a_device_with_no_process_group_are_refused_naming_world_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every device served today has a process group or is SPMD; a new one without either runs one rank.
    resolve = backends.resolve
    monkeypatch.setattr(
        backends, "resolve", lambda device: dataclasses.replace(resolve(device), collective_backend=None)
    )
    refused = _refusal(_decoder, world_size=2)
    assert (refused.field, refused.reason) == (
        "world_size",
        "must be 1: device cpu runs on one rank only, got 2",
    )
    assert _decoder(world_size=1).world_size == 1
