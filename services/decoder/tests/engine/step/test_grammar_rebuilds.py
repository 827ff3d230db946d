"""Grammar matchers rebuilt off the step's path (step/grammar_rebuilds.py): a request whose matcher fills
sits out while it is rebuilt, its neighbours decode on, and it rejoins with the answer it gets
unmetered; a request that leaves while rebuilding releases its blocks, its charge and its rebuild, and
a stop does not wait for one."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.decoder.tests.engine.engine_helpers import tokens as _tokens
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Event, Failed, Finished
from tandem.decoder.engine.params import SamplingParams, StoppingParams, StructuredOutput
from tandem.decoder.engine.sampling import grammar_growth, structured
from tandem.decoder.engine.sampling.grammar_growth import MeteredMatcher
from tandem.decoder.engine.sampling.grammar_memory import GrammarMemoryBudget
from tandem.decoder.engine.step.grammar_rebuilds import GrammarRebuilds
from tandem.decoder.models.loader import LoadedModel

WAIT_S = 30.0  # how long a test waits for what must happen; no assertion is about time
# Every character a new lexer state: greedy on the tiny model, the matcher fills within 40 tokens.
GROWING = StructuredOutput("regex", r"[\w .]{1,1000}")


class _Gate:
    """Holds every rebuild's replay (MeteredMatcher.continue_rebuild) until opened: each slice gives it
    nothing and says it is not done. Counts the replays done."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = threading.Event()
        self.open = threading.Event()
        self.num_done = 0
        replay = MeteredMatcher.continue_rebuild

        def gated(matcher: MeteredMatcher, max_seconds: float) -> bool:
            self.started.set()
            if not self.open.is_set() or not replay(matcher, max_seconds):
                return False
            self.num_done += 1
            return True

        monkeypatch.setattr(MeteredMatcher, "continue_rebuild", gated)


class _Stream:
    """One request's events, and when it ended."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ended = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, Finished | Failed):
            self.ended.set()


def _engine(model_dir: Path, loaded: LoadedModel, batch_invariant: bool = False) -> Engine:
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float32",
        num_kv_blocks=512,
        block_size=4,
        max_num_seqs=8,
        batch_invariant=batch_invariant,
    )
    return Engine(config, loaded)


def _growing(sampling: SamplingParams, speculative_tokens: int = 0) -> GenerateSpec:
    return GenerateSpec(
        [[3, 4]],
        sampling,
        StoppingParams(max_new_tokens=64),
        structured=GROWING,
        speculative_tokens=speculative_tokens,
    )


NEIGHBOUR = GenerateSpec(
    [[5, 6]], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=24, ignore_eos=True)
)


@pytest.mark.parametrize(
    ("sampling", "speculative_tokens", "batch_invariant"),
    [
        (SamplingParams(temperature=0.0), 0, False),
        (SamplingParams(temperature=0.8, seed=7), 4, False),
        (SamplingParams(temperature=0.8, seed=7), 0, True),
    ],
)
def test_a_neighbour_decodes_on_while_a_matcher_is_rebuilt_and_the_answer_is_the_unmetered_one(
    tiny_model_dir: Path,
    tiny_fp32: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
    sampling: SamplingParams,
    speculative_tokens: int,
    batch_invariant: bool,
) -> None:
    growing = _growing(sampling, speculative_tokens)
    with monkeypatch.context() as unmetered:  # one matcher of the limit of all, never rebuilt
        unmetered.setattr(grammar_growth, "FIRST_MAX_LEXER_STATES", structured.MAX_LEXER_STATES)
        with _engine(tiny_model_dir, tiny_fp32, batch_invariant) as engine:
            reference = _tokens(engine.generate(growing))
    gate = _Gate(monkeypatch)
    with _engine(tiny_model_dir, tiny_fp32, batch_invariant) as engine:
        rebuilding, neighbour = _Stream(), _Stream()
        engine.submit(growing, rebuilding)
        assert gate.started.wait(WAIT_S), "the matcher never filled"
        num_before = len(_tokens(rebuilding.events))
        engine.submit(NEIGHBOUR, neighbour)
        # Every token of the neighbour while the rebuild is held: the step never waits for it.
        assert neighbour.ended.wait(WAIT_S), "the neighbour stalled behind the rebuild"
        assert len(_tokens(rebuilding.events)) == num_before  # sitting out
        gate.open.set()
        assert rebuilding.ended.wait(WAIT_S)
    assert isinstance(neighbour.events[-1], Finished) and len(_tokens(neighbour.events)) == 24
    assert isinstance(rebuilding.events[-1], Finished) and gate.num_done >= 1
    assert _tokens(rebuilding.events) == reference


def test_a_request_cancelled_while_rebuilding_releases_its_blocks_its_charge_and_its_rebuild(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate(monkeypatch)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        memory = GrammarMemoryBudget()
        monkeypatch.setattr(engine._grammar_compiler(), "memory", memory)
        free = engine.core.block_manager.num_free_blocks
        stream = _Stream()
        key = engine.submit(_growing(SamplingParams(temperature=0.0)), stream)
        assert gate.started.wait(WAIT_S)
        engine.abort(key)
        deadline = time.monotonic() + WAIT_S
        while engine.core.num_live() and time.monotonic() < deadline:
            time.sleep(0.01)
        # Out of the engine and its blocks free while its rebuild is still held.
        assert engine.core.num_live() == 0 and engine.core.block_manager.num_free_blocks == free
        while memory.held() and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert memory.held() == 0  # its constraint went with it, its rebuild with it
        gate.open.set()
        assert not engine.core.has_work()  # nothing of its rebuild goes on
    assert gate.num_done == 0
    assert not stream.ended.is_set()  # an abort is silent


def test_an_engine_stop_while_a_matcher_is_rebuilt_does_not_wait_for_it(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate(monkeypatch)
    engine = _engine(tiny_model_dir, tiny_fp32).start()
    stream = _Stream()
    engine.submit(_growing(SamplingParams(temperature=0.0)), stream)
    assert gate.started.wait(WAIT_S)
    stopping = threading.Thread(target=engine.shutdown)
    stopping.start()
    stopping.join(WAIT_S)
    stopped = not stopping.is_alive()
    gate.open.set()
    assert stopped, "the stop waited for the rebuild"
    assert isinstance(stream.events[-1], Failed) and gate.num_done == 0


class _Replaying:
    """A constraint whose matcher's replay takes `num_slices` slices, each recorded with its limit."""

    def __init__(self, name: str, num_slices: int, slices: list[tuple[str, float]]) -> None:
        left = [num_slices]

        def start_rebuild() -> None:
            self.metered.is_rebuilding = True

        def continue_rebuild(max_seconds: float) -> bool:
            slices.append((name, max_seconds))
            left[0] -= 1
            return left[0] == 0

        self.metered = SimpleNamespace(
            is_rebuilding=False, start_rebuild=start_rebuild, continue_rebuild=continue_rebuild
        )


def _two_rebuilds(max_seconds_per_step: float) -> tuple[GrammarRebuilds, list[tuple[str, float]]]:
    """ "a" then "b" rebuilding, "a" in 2 slices and "b" in 1; and the slices they are given."""
    slices: list[tuple[str, float]] = []
    rebuilds = GrammarRebuilds(max_seconds_per_step)
    rebuilds.start("a", _Replaying("a", 2, slices))  # type: ignore[arg-type]
    rebuilds.start("b", _Replaying("b", 1, slices))  # type: ignore[arg-type]
    return rebuilds, slices


def test_a_rebuild_is_pending_until_its_replay_is_whole_a_slice_a_step() -> None:
    rebuilds, slices = _two_rebuilds(max_seconds_per_step=10.0)
    rebuilds.advance()
    # Each gets what the step's slice has left: "a" its first part, "b" all of its.
    assert [name for name, _ in slices] == ["a", "b"] and rebuilds.pending() == {"a"}
    assert all(0.0 < limit <= 10.0 for _, limit in slices)
    rebuilds.advance()
    assert rebuilds.pending() == set()


def test_a_step_slice_spent_leaves_the_younger_rebuilds_for_the_next_step() -> None:
    rebuilds, slices = _two_rebuilds(max_seconds_per_step=0.0)
    rebuilds.advance()
    assert slices == [("a", 0.0)] and rebuilds.pending() == {"a", "b"}


def test_a_dropped_requests_rebuild_goes_no_further() -> None:
    slices: list[tuple[str, float]] = []
    rebuilds = GrammarRebuilds()
    rebuilds.start("a", _Replaying("a", 2, slices))  # type: ignore[arg-type]
    rebuilds.drop(live={"b"})
    rebuilds.advance()
    assert slices == [] and rebuilds.pending() == set()
