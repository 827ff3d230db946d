"""How rank 0 ends the ranks it spawned when its start fails with a flag's error. The KV pool refusal
the group agreed on (KvPoolRefused) is every rank's: they stop by themselves and are only waited for.
Any other ConfigError (the port taken since it was checked) is rank 0's alone, while the others still
load: they are ended at once. Every ConfigError was taken for the agreed refusal: rank 0 waited 5 s
for each loading rank and logged a false ERROR that it 'did not exit' before killing it. Any other
error ends them as a failed rank 0 does."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.api import rank_group
from tandem.decoder.api.serving import Outcome
from tandem.decoder.config import DecoderConfig, EngineConfig
from tandem.decoder.distributed.parallel import RankInfo
from tandem.decoder.engine.step.kv_pool_agreement import KvPoolRefused


class SpawnedRank:
    """A spawned rank as rank 0 sees it: one that stops by itself ends when joined; one still loading
    runs until it is terminated (or killed)."""

    name = "tandem-rank-1"

    def __init__(self, stops_by_itself: bool) -> None:
        self.stops_by_itself = stops_by_itself
        self.exitcode: int | None = None
        self.signals: list[str] = []

    def join(self, timeout: float | None = None) -> None:
        if self.stops_by_itself:
            self.exitcode = 2
        elif self.signals:
            self.exitcode = -15 if self.signals[0] == "terminate" else -9

    def is_alive(self) -> bool:
        return self.exitcode is None

    def terminate(self) -> None:
        self.signals.append("terminate")

    def kill(self) -> None:
        self.signals.append("kill")


def serve_ranks_failing(
    error: BaseException, rank: SpawnedRank, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 of two, whose serve raises `error`; the error must come out of serve_ranks."""

    async def serve(*_: object, **__: object) -> Outcome:
        raise error

    monkeypatch.setattr(rank_group, "serve", serve)
    monkeypatch.setattr(rank_group, "_spawn_ranks", lambda *_: [rank])
    config = DecoderConfig(engine=EngineConfig(model_dir=Path("m")), world_size=2)
    with caplog.at_level(logging.INFO), pytest.raises(type(error)) as raised:
        rank_group.serve_ranks(config, RankInfo.local(0, 2, 1))
    assert raised.value is error


def test_a_config_error_of_rank_0_alone_ends_the_loading_ranks_at_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    loading = SpawnedRank(stops_by_itself=False)
    serve_ranks_failing(ConfigError("port", ": 127.0.0.1:1 is taken"), loading, monkeypatch, caplog)
    assert loading.signals == ["terminate"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_agreed_pool_refusal_waits_for_the_ranks_stopping_by_themselves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stopping = SpawnedRank(stops_by_itself=True)
    refused = KvPoolRefused("num_kv_blocks", ": the KV pool it asks for (...) could not be allocated")
    serve_ranks_failing(refused, stopping, monkeypatch, caplog)
    assert (stopping.signals, stopping.exitcode) == ([], 2)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "error",
    [AssertionError("a bug"), OSError(24, "Too many open files"), KeyboardInterrupt()],
    ids=["a bug", "an OSError", "KeyboardInterrupt"],
)
def test_any_other_error_of_rank_0_ends_its_ranks_rather_than_leave_them_orphans(
    error: BaseException, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the two ConfigErrors ended them: any other error left ranks 1..N-1 running (loading, or
    waiting on collectives) after rank 0's process exited, each holding its memory until the group's
    timeout. One told to stop exits by itself; one still loading is ended, and named."""
    told, loading = SpawnedRank(stops_by_itself=True), SpawnedRank(stops_by_itself=False)
    serve_ranks_failing(error, told, monkeypatch, caplog)
    assert (told.signals, told.exitcode) == ([], 2)
    serve_ranks_failing(error, loading, monkeypatch, caplog)
    assert (loading.signals, loading.exitcode) == (["terminate"], -15)
    assert "ending tandem-rank-1: still running 1 s after rank 0 failed" in caplog.text


def serve_ranks_failed(rank: SpawnedRank, monkeypatch: pytest.MonkeyPatch) -> int:
    """Rank 0 of two, whose serve ends FAILED (a step's fault, a load that failed); its exit code. It
    leaves by os._exit: a word to a hung rank still queued held the interpreter's exit up to the group
    timeout."""

    async def serve(*_: object, **__: object) -> Outcome:
        return Outcome.FAILED

    exited: list[str] = []
    monkeypatch.setattr(rank_group, "serve", serve)
    monkeypatch.setattr(rank_group, "_spawn_ranks", lambda *_: [rank])
    monkeypatch.setattr(rank_group, "_exit_failed", lambda: exited.append("os._exit(1)"))
    config = DecoderConfig(engine=EngineConfig(model_dir=Path("m")), world_size=2)
    code = rank_group.serve_ranks(config, RankInfo.local(0, 2, 1))
    assert exited == ["os._exit(1)"]
    return code


def test_a_failed_rank_0_ends_a_rank_no_word_reaches_rather_than_wait_out_the_group_timeout(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Inside a step's collectives (or still loading) it would fail only at the group's timeout. Its
    own log ends without a word, so rank 0's names it."""
    stuck = SpawnedRank(stops_by_itself=False)
    assert serve_ranks_failed(stuck, monkeypatch) == 1
    assert stuck.signals == ["terminate"]
    assert "ending tandem-rank-1: still running 1 s after rank 0 failed" in caplog.text


def test_a_failed_rank_0_lets_a_rank_told_abort_exit_by_itself(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    told = SpawnedRank(stops_by_itself=True)
    assert serve_ranks_failed(told, monkeypatch) == 1
    assert told.signals == []
    assert "ending" not in caplog.text
