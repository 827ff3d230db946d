"""A KV pool one rank of a group cannot allocate is the group's start error, said once by rank 0 as
the flag that sized it, with that rank's blocks and bytes (exit 2); the other ranks stop with it,
without a traceback. (Such a rank ended alone with a traceback and exit 1, and rank 0 learned of it
only when its next collective failed: 'could not load', exit 1, naming no flag.) Any other error on a
rank, a ConfigError too, is that rank's own failure, said there with its traceback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.config import DecoderConfig, EngineConfig
from tandem.decoder.distributed import worker
from tandem.decoder.distributed.parallel import RankInfo
from tandem.decoder.engine.step.kv_pool_agreement import KvPoolRefused

from . import scenarios
from .harness import run_ranks


def test_a_pool_refused_on_any_rank_is_every_ranks_start_error_naming_that_rank(tiny_model_dir: Path) -> None:
    rank0, rank1 = run_ranks(scenarios.rank_pool_refusals, 2, tiny_model_dir, [1, 0], timeout_s=120)
    assert rank0 == rank1  # every rank knows the same refusal
    on_rank_1, on_rank_0 = rank0
    for said, rank in ((on_rank_1, 1), (on_rank_0, 0)):
        assert said.startswith("num_kv_blocks: the KV pool it asks for (256 blocks, "), said
        host = f"rank {rank}'s host"
        assert (
            f" bytes on rank {rank}) could not be allocated (more than the 1 bytes of memory of {host})"
            in said
        )


def run_worker_raising(
    error: Exception, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> int:
    """Rank 1's run_worker when its start raises `error`."""

    def refuse(*_: object) -> None:
        raise error

    monkeypatch.setattr(worker, "init_parallel", lambda *_: None)
    monkeypatch.setattr(worker, "run_steps", refuse)
    config = DecoderConfig(engine=EngineConfig(model_dir=tmp_path), world_size=2)
    with caplog.at_level(logging.INFO, logger="tandem.decoder"):
        return worker.run_worker(RankInfo.local(1, 2, 1), config)


def test_a_rank_stopping_for_the_agreed_pool_refusal_exits_2_with_one_line_and_no_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    refused = KvPoolRefused("num_kv_blocks", ": the KV pool it asks for (...) could not be allocated")
    assert run_worker_raising(refused, monkeypatch, caplog, tmp_path) == 2
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"rank 1 stopped: {refused}")
    ]
    assert not any(r.exc_info for r in caplog.records)


def test_any_other_config_error_on_a_rank_is_its_failure_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Rank 0 knows nothing of it (it shows there as the group's connection closed): this rank's log is
    the only place it is said, so it is an ERROR with its traceback, and exit 1, not a quiet exit 2."""
    own = ConfigError("kv_cache_bytes", "must be at most 5, got 6")
    assert run_worker_raising(own, monkeypatch, caplog, tmp_path) == 1
    [record] = caplog.records
    assert (record.levelno, record.getMessage()) == (logging.ERROR, "rank 1 failed; exiting")
    assert record.exc_info is not None and record.exc_info[1] is own
