"""A KV pool one rank of a group cannot allocate is the group's start error, said once by rank 0 as
the flag that sized it, with that rank's blocks and bytes (exit 2); the other ranks stop with it,
without a traceback. A rank but 0 ended alone with a traceback and exit 1, and rank 0 learned of it
only when its next collective failed ('could not load', exit 1), naming no flag."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.config import DecoderConfig, EngineConfig
from tandem.decoder.distributed import worker
from tandem.decoder.distributed.parallel import RankInfo

from . import scenarios
from .harness import run_ranks


def test_a_pool_refused_on_any_rank_is_every_ranks_start_error_naming_that_rank(tiny_model_dir: Path) -> None:
    rank0, rank1 = run_ranks(scenarios.rank_pool_refusals, 2, tiny_model_dir, [1, 0], timeout_s=120)
    assert rank0 == rank1  # every rank knows the same refusal
    on_rank_1, on_rank_0 = rank0
    for said, rank in ((on_rank_1, 1), (on_rank_0, 0)):
        assert said.startswith("num_kv_blocks: the KV pool it asks for (256 blocks, "), said
        assert (
            f" bytes on rank {rank}) could not be allocated (more than this host's 1 bytes of memory)" in said
        )


def test_a_rank_that_cannot_start_for_a_flag_exits_2_with_one_line_and_no_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    refused = ConfigError("num_kv_blocks", ": the KV pool it asks for (...) could not be allocated")

    def refuse(*_: object) -> None:
        raise refused

    monkeypatch.setattr(worker, "init_parallel", lambda *_: None)
    monkeypatch.setattr(worker, "run_steps", refuse)
    config = DecoderConfig(engine=EngineConfig(model_dir=tmp_path), world_size=2)
    with caplog.at_level(logging.INFO, logger="tandem.decoder"):
        assert worker.run_worker(RankInfo.local(1, 2, 1), config) == 2
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"rank 1 stopped: {refused}")
    ]
    assert not any(r.exc_info for r in caplog.records)
