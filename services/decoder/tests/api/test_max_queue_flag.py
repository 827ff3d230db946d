"""`--max-queue` and the calls the decoder's server holds: the server's bound on calls at once
(max_concurrent_rpcs) follows from the queue and the batch, so the queue's own RESOURCE_EXHAUSTED,
naming it, answers before the server's bound on calls, which names no flag; a queue past
MAX_QUEUE_LIMIT or a batch past MAX_NUM_SEQS_LIMIT is one line naming the flag and exit 2, before any
weight is read, and no pair of them asks more calls than a server may hold."""

from __future__ import annotations

import pytest

from tandem.client.errors import ConfigError
from tandem.common.health import max_watches
from tandem.common.server_options import DEFAULT_MAX_CONCURRENT_RPCS, MAX_CONCURRENT_RPCS_LIMIT, ServerOptions
from tandem.decoder.api.main import config_from_args
from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.config import (
    MAX_NUM_SEQS_LIMIT,
    MAX_QUEUE_LIMIT,
    NUM_SPARE_CALLS,
    DecoderConfig,
    EngineConfig,
    max_calls,
)

PREFIX = "tandem serve decoder: --max-queue (TANDEM_MAX_QUEUE)"


@pytest.mark.parametrize("max_queue", [1, 1024, 10_000, 50_000, MAX_QUEUE_LIMIT])
def test_the_server_holds_every_stream_waiting_and_running_beside_all_health_watches(max_queue: int) -> None:
    config = config_from_args(["--max-queue", str(max_queue), "--max-num-seqs", "64"])
    bound = config.server.max_concurrent_rpcs
    assert bound == max_calls(config.engine) >= DEFAULT_MAX_CONCURRENT_RPCS
    # Health's Watch streams may hold their share of the places; the streams and the spare calls fit
    # in what is left, so the queue refuses first, naming its flag.
    assert bound - max_watches(bound) >= max_queue + 64 + NUM_SPARE_CALLS


def test_at_the_defaults_the_server_holds_what_every_server_holds() -> None:
    assert config_from_args([]).server.max_concurrent_rpcs == DEFAULT_MAX_CONCURRENT_RPCS


def test_a_queue_past_the_limit_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert decoder_main(["--max-queue", str(MAX_QUEUE_LIMIT + 1), "--port", "0"]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"{PREFIX} must be at most 100,000 (") and said.endswith(", got 100,001\n")


@pytest.mark.parametrize("max_num_seqs", [str(MAX_NUM_SEQS_LIMIT + 1), "1100000000"])
def test_a_batch_past_the_limit_is_refused_naming_the_flag(
    max_num_seqs: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It sizes the server's bound on calls too: 1,100,000,000 failed the start with an OverflowError
    in gRPC's arguments (exit 1, a traceback), 1,000,000 held 2,004,096 calls."""
    assert decoder_main(["--max-num-seqs", max_num_seqs, "--port", "0"]) == 2
    said = capsys.readouterr().err
    prefix = "tandem serve decoder: --max-num-seqs (TANDEM_MAX_NUM_SEQS) must be at most 100,000 ("
    assert said.startswith(prefix) and said.endswith(f", got {int(max_num_seqs):,}\n")


def test_at_both_limits_the_server_holds_what_a_server_may_hold() -> None:
    argv = ["--max-queue", str(MAX_QUEUE_LIMIT), "--max-num-seqs", str(MAX_NUM_SEQS_LIMIT)]
    assert config_from_args(argv).server.max_concurrent_rpcs == 402_048 <= MAX_CONCURRENT_RPCS_LIMIT


def test_a_config_whose_server_cannot_hold_its_queue_is_refused_naming_both_numbers(tmp_path) -> None:
    engine = EngineConfig(model_dir=tmp_path, max_queue=20_000, max_num_seqs=64)
    with pytest.raises(ConfigError) as error:
        DecoderConfig(engine, server=ServerOptions(max_concurrent_rpcs=DEFAULT_MAX_CONCURRENT_RPCS))
    assert error.value.field == "max_queue"
    assert "need a server holding 42,176 calls at once (max_calls), which holds 10,000" in str(error.value)
    assert DecoderConfig(engine, server=ServerOptions(max_concurrent_rpcs=42_176)).engine.max_queue == 20_000
