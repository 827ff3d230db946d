"""Rank 0 failing while the other ranks wait on it tells them where they wait: in the KV pool's
agreement before it (its set-up failed: loading, its chat template), by ABORT on the step feed after it
(building its step core, warmup in start(), a step's fault). They stop at once, exit 1, and say in one
line that rank 0 failed. (They were told nothing and waited out the group timeout, 60 s by default,
with a local rank 0 waiting as long for them.) Telling them never holds rank 0 up: its last word (ABORT,
STOP) waits 1 s at most, then is left queued, so a rank still inside a step's collectives takes it once
they end (or fails at their timeout) and a hung one never holds rank 0's shutdown. A clean shutdown
still sends one STOP, however often it is called; one asked while a step runs that then fails sends
ABORT."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.decoder.config import DecoderConfig, EngineConfig
from tandem.decoder.distributed import worker
from tandem.decoder.distributed.parallel import RankInfo
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.step import kv_pool_agreement, sizing
from tandem.decoder.engine.step.rank_zero_failed import RankZeroFailed
from tandem.decoder.engine.step.runner import ModelRunner

from . import scenarios
from .harness import run_ranks

LATE_S = 1.5  # a slower load of rank 1, longer than rank 0 waits to say it failed (SAY_FAILED_WAIT_S)


def test_the_other_ranks_stop_at_once_when_rank_0_fails_before_or_after_the_pool_agreement(
    tiny_model_dir: Path,
) -> None:
    """Two real ranks; the harness's group timeout is 30 s, which a rank told nothing waits out."""
    assert LATE_S > kv_pool_agreement.SAY_FAILED_WAIT_S
    points = ["template", "core"]
    rank0, rank1 = run_ranks(scenarios.rank_zero_failures, 2, tiny_model_dir, points, LATE_S, timeout_s=25)
    assert [said for said, _ in rank0] == [
        *(f"RuntimeError: injected at {p}" for p in points),
        "TimeoutError: not every rank took it within 0.1 s",
        "[0, 1]",
    ]
    assert [said for said, _ in rank1] == [
        "RankZeroFailed: rank 0 failed before the KV pool's agreement",  # though it came late
        "RankZeroFailed: rank 0 failed",  # ABORT
        "[7]",  # a word rank 0 stopped waiting for is still taken
        "[0, 1]",  # the control group is still in step
    ]
    assert rank0[0][1] < LATE_S and rank0[2][1] < LATE_S, rank0  # neither waited for the slower rank
    assert all(seconds < 10 for _, seconds in rank1[:2]), rank1  # a load, then rank 0's word


class Feed:
    """A group of one (identity collectives) whose feed to the other ranks records what it is told.
    `is_broken`: its collectives raise, as a group's do when a rank hangs or dies inside a step, and
    the last word (STOP, ABORT) is not taken within its bound (StepSender's TimeoutError)."""

    rank, world_size, timeout_s = 0, 1, 60.0
    rank_tensor = torch.tensor(0)

    def __init__(self, is_broken: bool = False) -> None:
        self.said: list[str] = []
        self.is_broken = is_broken

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_broken:
            raise RuntimeError("Timed out waiting 60000ms for recv operation to complete")
        return x

    all_gather_seq = reduce_scatter_seq = all_gather_last = all_reduce

    def all_gather_control(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor:
        if x[0] == kv_pool_agreement.FAILED:
            self.said.append("agreement: failed")
        return x.unsqueeze(0)

    def step_sender(self) -> Feed:
        return self

    def send(self, batch) -> None:
        self.said.append("step")

    def install_adapter(self, slot: int, adapter) -> None:
        pass

    def keepalive(self) -> None:
        pass

    def stop(self) -> None:
        self._last_word("stop")

    def abort(self) -> None:
        self._last_word("abort")

    def _last_word(self, word: str) -> None:
        self.said.append(word)
        if self.is_broken:
            raise TimeoutError("not every rank took it within 1 s")


def refuse(*_: object, **__: object) -> None:
    raise RuntimeError("injected")


def run_until_it_fails(feed: Feed, model_dir: Path) -> None:
    """An engine on `feed` given a request, shut down once its loop has failed."""
    engine = Engine(scenarios.engine_config(model_dir), tp=feed).start()  # type: ignore[arg-type]
    engine.submit(scenarios.greedy_spec([1, 2, 3], 2), lambda _: None)
    deadline = time.monotonic() + 10
    while engine.is_healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.is_healthy
    engine.shutdown()


def test_a_step_failing_inside_its_forward_still_sends_abort_and_shutdown_returns(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its collective failed (a rank hung or died in it) or rank 0 failed before or after the step's
    collectives: the others may be inside them, or back on the feed waiting for the next step (told
    nothing, they waited as long as rank 0 lived). ABORT waits 1 s at most for them."""
    feed = Feed(is_broken=True)
    run_until_it_fails(feed, tiny_model_dir)
    assert feed.said == ["step", "abort"]
    assert "did not take ABORT at once" in caplog.text


def test_a_step_failing_after_its_forward_sends_abort_at_shutdown(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The others finished the forward with this rank and wait on the feed for the next step."""
    forward = ModelRunner.forward

    def failing_after(self: ModelRunner, batch: object) -> torch.Tensor:
        forward(self, batch)  # type: ignore[arg-type]
        raise RuntimeError("injected after the forward")

    monkeypatch.setattr(ModelRunner, "forward", failing_after)
    feed = Feed()
    run_until_it_fails(feed, tiny_model_dir)
    assert feed.said == ["step", "abort"]


def static_config(model_dir: Path) -> EngineConfig:
    return scenarios.engine_config(model_dir, {"static_shapes": True})  # start() warms every bucket up


def test_a_warmup_failing_inside_its_forward_sends_abort_and_start_raises_its_fault(
    tiny_model_dir: Path,
) -> None:
    feed = Feed(is_broken=True)
    engine = Engine(static_config(tiny_model_dir), tp=feed)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="Timed out"):  # the step's, not the ABORT's bound
        engine.start()
    assert feed.said == ["step", "abort"]


def test_a_warmup_failing_between_its_forwards_sends_abort(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ModelRunner, "warm_up", refuse)
    feed = Feed()
    engine = Engine(static_config(tiny_model_dir), tp=feed)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="injected"):
        engine.start()
    assert feed.said == ["abort"]


def test_a_clean_shutdown_sends_stop_once_however_often_it_is_called(tiny_model_dir: Path) -> None:
    """A second STOP would be read by no worker: the control group would be out of step."""
    feed = Feed()
    engine = Engine(scenarios.engine_config(tiny_model_dir), tp=feed).start()  # type: ignore[arg-type]
    engine.shutdown()
    engine.shutdown()
    assert feed.said == ["stop"]


def test_a_shutdown_asked_while_a_step_runs_that_then_fails_sends_abort_not_stop(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drain while a peer hangs in the step: the step fails at the group timeout after the drain
    began; STOP then went to the hung rank and waited out a second timeout."""
    forward = ModelRunner.forward
    running, release = threading.Event(), threading.Event()

    def hung_peer(self: ModelRunner, batch: object) -> torch.Tensor:
        forward(self, batch)  # type: ignore[arg-type]
        running.set()
        release.wait(10)
        raise RuntimeError("Timed out waiting 60000ms for recv operation to complete")

    monkeypatch.setattr(ModelRunner, "forward", hung_peer)
    feed = Feed()
    engine = Engine(scenarios.engine_config(tiny_model_dir), tp=feed).start()  # type: ignore[arg-type]
    engine.submit(scenarios.greedy_spec([1, 2, 3], 2), lambda _: None)
    assert running.wait(10)
    threading.Timer(0.05, release.set).start()  # the timeout, once shutdown waits for the step
    engine.shutdown()
    assert feed.said == ["step", "abort"]


def test_a_set_up_failing_before_the_agreement_says_so_there_and_sends_nothing_on_the_feed(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The others wait in the agreement's gather, not yet in their step loops."""
    monkeypatch.setattr(sizing, "check_sliding_window", refuse)
    feed = Feed()
    with pytest.raises(RuntimeError, match="injected"):
        Engine(scenarios.engine_config(tiny_model_dir), tp=feed)  # type: ignore[arg-type]
    assert feed.said == ["agreement: failed"]


def test_a_worker_told_rank_0_failed_exits_1_with_one_line_and_no_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Rank 0's log has the failure and its traceback; this rank's says only that it stops for it."""

    def told(*_: object) -> None:
        raise RankZeroFailed("rank 0 failed")

    monkeypatch.setattr(worker, "init_parallel", lambda *_: None)
    monkeypatch.setattr(worker, "run_steps", told)
    config = DecoderConfig(engine=EngineConfig(model_dir=tmp_path), world_size=2)
    with caplog.at_level(logging.INFO, logger="tandem.decoder"):
        assert worker.run_worker(RankInfo.local(1, 2, 1), config) == 1
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, "rank 1 stopping: rank 0 failed (its log says why)")
    ]
    assert not any(r.exc_info for r in caplog.records)
