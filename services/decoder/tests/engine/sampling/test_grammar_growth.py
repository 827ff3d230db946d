"""A matcher's growth while decoding: its lexer states are charged a tranche at a time as they fill, its
masks what an unmetered matcher's are, and a growth the budget refuses fails its request alone, naming
its field and the limit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import tokenizers
import torch

from tandem.client.errors import InvalidArgument, ResourceExhausted
from tandem.decoder.engine.params import StructuredOutput
from tandem.decoder.engine.sampling.constraint import Constraint
from tandem.decoder.engine.sampling.deep_stack import on_deep_stack
from tandem.decoder.engine.sampling.grammar_growth import (
    BYTES_PER_LEXER_STATE,
    EXPENSIVE_REPLAY_SECONDS,
    FIRST_MAX_LEXER_STATES,
    MatcherFull,
    MeteredMatcher,
    growth_bytes,
)
from tandem.decoder.engine.sampling.grammar_memory import MIB, GrammarMemoryBudget
from tandem.decoder.engine.sampling.structured import GrammarCompiler

# Every character a new lexer state, and each mask explores the tokens that go on from it: about 60
# states a token of one character with SmolLM2's vocabulary, past the first tranche within 20.
GROWING = StructuredOutput("regex", r"[\w .]{1,1000}")
LIMIT_S = 10.0  # no test here is about CPU time


@pytest.fixture
def untimed_compiler(tiny_model_dir: Path) -> GrammarCompiler:
    """This file's own compiler, not the folder's `compiler` (conftest.py: at the served per-token limit,
    one a module): a per-token CPU limit no test here reaches, and a new one for each test."""
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    return GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), (eos,), max_token_cpu_seconds=LIMIT_S)


@pytest.fixture
def answer(tiny_model_dir: Path) -> list[int]:
    """Tokens of one letter each, which GROWING takes: a new state each."""
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    letters = [tokenizer.token_to_id(c) for c in "abcdefghijklmnopqrstuvwxyz"]
    return [letters[i % len(letters)] for i in range(400)]


def _decode(constraint: Constraint, tokens: list[int]) -> list[torch.Tensor]:
    """The masks before each of `tokens`, each taken; stops where the constraint fails."""
    masks = []
    for token_id in tokens:
        masks.append(constraint.allowed())
        constraint.accept(token_id)
        if constraint.error() is not None:
            break
    return masks


def _unmetered_masks(compiler: GrammarCompiler, tokens: list[int]) -> list[torch.Tensor]:
    """The reference: GROWING's masks on one matcher of the served limit from the start, never built
    again."""
    reference = Constraint(
        compiler._matcher(compiler._cache[GROWING]), compiler.vocab_size, max_token_cpu_seconds=LIMIT_S
    )
    return _decode(reference, tokens)


def _ten_tokens_in(compiler: GrammarCompiler, answer: list[int]) -> tuple[Constraint, MeteredMatcher]:
    """A constraint of GROWING ten tokens into `answer`, its matcher still in its first tranche."""
    constraint = compiler.constraint(GROWING)
    _decode(constraint, answer[:10])
    metered = constraint.metered
    assert metered is not None and metered.max_states == FIRST_MAX_LEXER_STATES
    return constraint, metered


def test_growth_is_charged_a_kibibyte_a_state_past_the_first_tranche_the_floor_covers() -> None:
    assert growth_bytes(FIRST_MAX_LEXER_STATES) == 0 == growth_bytes(10)
    assert growth_bytes(4 * FIRST_MAX_LEXER_STATES) == 3 * FIRST_MAX_LEXER_STATES * BYTES_PER_LEXER_STATE


def test_an_ordinary_grammar_never_leaves_its_first_tranche(untimed_compiler: GrammarCompiler) -> None:
    constraint = untimed_compiler.constraint(StructuredOutput("json_object", ""))
    _decode(constraint, [int(constraint.allowed().nonzero()[0])])
    assert constraint.metered is not None and constraint.metered.max_states == FIRST_MAX_LEXER_STATES
    assert constraint.metered.charged_bytes == 0


def _decode_deferring(constraint: Constraint, tokens: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """As _decode, a matcher that defers its rebuilds: each MatcherFull answered by rebuild() and the
    mask asked again, as the engine does. Also what its caller held at each MatcherFull."""
    metered = constraint.metered
    assert metered is not None
    metered.defers_rebuilds = True
    masks: list[torch.Tensor] = []
    held_when_full: list[int] = []
    for token_id in tokens:
        while True:
            try:
                masks.append(constraint.allowed())
                break
            except MatcherFull:
                # Full: its growth is charged already, and it has no error to tell meanwhile.
                assert metered.is_full and not constraint.is_error and constraint.error() is None
                held_when_full.append(constraint.memory_bytes)
                metered.start_rebuild()
                assert metered.continue_rebuild(max_seconds=LIMIT_S) and not metered.is_full
        constraint.accept(token_id)
        if constraint.error() is not None:
            break
    return masks, held_when_full


@pytest.mark.parametrize("defers", [False, True])
def test_a_growing_matcher_is_charged_as_its_states_fill_and_masks_as_an_unmetered_one(
    untimed_compiler: GrammarCompiler, answer: list[int], monkeypatch: pytest.MonkeyPatch, defers: bool
) -> None:
    # Deferring (as the engine's matchers do): full once its growth is charged, built again after.
    monkeypatch.setattr(untimed_compiler, "memory", GrammarMemoryBudget())
    constraint = untimed_compiler.constraint(GROWING, caller="a")
    built = constraint.memory_bytes
    tokens = answer[:120]
    if defers:
        masks, held_when_full = _decode_deferring(constraint, tokens)
        assert held_when_full and held_when_full[0] > built
    else:
        masks = _decode(constraint, tokens)
    metered = constraint.metered
    assert metered is not None and metered.max_states > FIRST_MAX_LEXER_STATES  # built again, larger
    assert constraint.error() is None and len(masks) == len(tokens)
    assert (
        constraint.memory_bytes
        == built + growth_bytes(metered.max_states)
        == untimed_compiler.memory.held("a")
    )
    assert all(
        torch.equal(a, b) for a, b in zip(masks, _unmetered_masks(untimed_compiler, tokens), strict=True)
    )
    del constraint, metered  # its request ended: every tranche given back with its build's charge
    assert untimed_compiler.memory.held() == 0


def test_a_proposal_rolled_back_across_a_rebuild_leaves_the_state_where_it_was(
    untimed_compiler: GrammarCompiler, answer: list[int]
) -> None:
    constraint, metered = _ten_tokens_in(untimed_compiler, answer)
    tokens = answer[:60]
    constraint.masks_along(tokens[10:])  # the states fill on the way, and are rolled back after
    assert metered.max_states > FIRST_MAX_LEXER_STATES
    reference = untimed_compiler.constraint(GROWING)
    _decode(reference, tokens[:10])
    assert torch.equal(constraint.allowed(), reference.allowed())


def test_a_growth_past_its_callers_limit_among_its_other_grammars_fails_that_request_for_a_retry(
    untimed_compiler: GrammarCompiler, answer: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(untimed_compiler, "memory", GrammarMemoryBudget(max_bytes_per_caller=8 * MIB))
    others = untimed_compiler.memory.reserve("a", "structured.regex", 3 * MIB)  # its other live grammars'
    growing = untimed_compiler.constraint(GROWING, caller="a")
    neighbour = untimed_compiler.constraint(GROWING, caller="b")
    tokens = answer[:400]
    masks = _decode(growing, tokens)
    error = growing.error()
    assert isinstance(error, ResourceExhausted) and error.retry_after_s and len(masks) < len(tokens)
    # Counted: the tokens sent, not the failing step's (its token is never sent).
    assert str(error).startswith(
        f"structured.regex: the grammar's matcher grew while decoding, after {len(masks) - 1} tokens of "
        "the answer past "
    )
    assert "the limit is 8 MiB per caller" in str(error)
    assert untimed_compiler.memory.held("a") == growing.memory_bytes + 3 * MIB <= 8 * MIB
    # Another caller's request of the same grammar goes on within its own limit (half the answer).
    assert len(_decode(neighbour, tokens[: len(masks) // 2])) == len(masks) // 2
    assert neighbour.error() is None
    others()


def test_a_growth_that_alone_passes_its_callers_limit_is_invalid_not_a_retry_that_fails_for_ever(
    untimed_compiler: GrammarCompiler, answer: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caller's only grammar: no other's end would make room, so a retry fails at the same token.
    monkeypatch.setattr(untimed_compiler, "memory", GrammarMemoryBudget(max_bytes_per_caller=8 * MIB))
    growing = untimed_compiler.constraint(GROWING, caller="a")
    masks = _decode(growing, answer[:400])
    error = growing.error()
    assert isinstance(error, InvalidArgument) and error.field == "structured.regex"
    assert f"after {len(masks) - 1} tokens of the answer" in str(error)
    assert "its matcher alone would hold about" in str(error) and "over the 8 MiB" in str(error)


class _FillingMatcher:
    """An llguidance matcher's stand-in that fills its lexer states at its third mask unless built past
    the first tranche, and whose replay costs REPLAY_CPU_S of CPU: a rebuild's, timed."""

    REPLAY_CPU_S = 0.05

    def __init__(self, max_states: int) -> None:
        self.max_states = max_states
        self.num_tokens = 0
        self.error = ""

    def compute_bitmask(self) -> bytes:
        if self.num_tokens == 2 and self.max_states <= FIRST_MAX_LEXER_STATES:
            self.error = f"too many states: {self.max_states} >= {self.max_states}"
        return b"\xff" * 4

    def consume_token(self, token_id: int) -> bool:
        self.num_tokens += 1
        return True

    def consume_tokens(self, token_ids: list[int]) -> int:
        start = time.thread_time()
        while time.thread_time() - start < self.REPLAY_CPU_S:
            pass
        self.num_tokens += len(token_ids)
        return len(token_ids)

    def is_stopped(self) -> bool:
        return bool(self.error)

    def is_error(self) -> bool:
        return bool(self.error)

    def get_error(self) -> str:
        return self.error


def test_a_rebuild_and_its_replay_are_not_the_grammars_work_and_count_in_no_cpu_limit() -> None:
    # A replay is the answer's parsing again in one step (`s: s s | "a"` after 300 tokens: 333 ms);
    # counted, it failed for the CPU limits a request that finishes unmetered.
    threads = []

    def aside(work):  # noqa: ANN001, ANN202 (MeteredMatcher's `aside`)
        threads.append(threading.current_thread())
        return on_deep_stack(work)

    metered = MeteredMatcher(_FillingMatcher, 50_000, aside=aside)
    constraint = Constraint(metered, 32, max_token_cpu_seconds=0.005)  # counted, 6.3 ms
    for token_id in (1, 2, 3):
        constraint.allowed()
        constraint.accept(token_id)
    assert metered.max_states == 2 * FIRST_MAX_LEXER_STATES and threads  # built again, aside
    assert metered.rebuild_seconds >= _FillingMatcher.REPLAY_CPU_S
    assert constraint.mask_seconds < 0.005 and constraint.error() is None
    assert metered.take_rebuild_seconds() >= _FillingMatcher.REPLAY_CPU_S  # its step's budget's, once
    assert metered.take_rebuild_seconds() == 0.0


class _DearlyParsedMatcher(_FillingMatcher):
    """Its tokens cost 30 ms each to take, so a replay of two is predicted dear; replays cost nothing."""

    REPLAY_CPU_S = 0.0

    def consume_token(self, token_id: int) -> bool:
        start = time.thread_time()
        while time.thread_time() - start < 0.030:
            pass
        return super().consume_token(token_id)


def test_a_matcher_whose_replay_would_be_dear_grows_to_its_limit_of_all_in_one_charged_tranche() -> None:
    # A replay is the answer's parsing again while its step's neighbours wait: `s: s s | "a"` after
    # 500 tokens, about 3 s each, and 6 doublings meant 6 of them (a neighbour's worst gap 8.6 s).
    charged = []
    metered = MeteredMatcher(_DearlyParsedMatcher, 50_000)
    metered.charge = charged.append
    for token_id in (1, 2, 3):
        metered.compute_bitmask()
        metered.consume_token(token_id)
    assert metered.consume_seconds > EXPENSIVE_REPLAY_SECONDS
    assert metered.max_states == 50_000 and charged == [growth_bytes(50_000)]


def test_a_proposal_that_fills_a_deferring_matcher_is_left_out_of_its_rebuild(
    untimed_compiler: GrammarCompiler, answer: list[int]
) -> None:
    constraint, metered = _ten_tokens_in(untimed_compiler, answer)
    tokens = answer[:60]
    metered.defers_rebuilds = True
    with pytest.raises(MatcherFull):
        constraint.masks_along(tokens[10:])
    metered.start_rebuild()
    assert metered.continue_rebuild(max_seconds=LIMIT_S)
    reference = untimed_compiler.constraint(GROWING)
    _decode(reference, tokens[:10])
    assert torch.equal(constraint.allowed(), reference.allowed())


def test_a_rebuild_replays_the_answer_a_slice_at_a_time_and_takes_the_full_ones_place_once_whole() -> None:
    # llguidance takes tokens holding the GIL: the engine gives a replay slices of its steps.
    metered = MeteredMatcher(_FillingMatcher, 50_000)
    metered.defers_rebuilds = True
    for token_id in (1, 2):
        metered.compute_bitmask()
        metered.consume_token(token_id)
    with pytest.raises(MatcherFull):
        metered.compute_bitmask()
    full = metered._matcher
    metered.start_rebuild()
    assert not metered.continue_rebuild(max_seconds=0.0)  # a token at least, then the slice is over
    assert metered.is_full and metered._matcher is full
    assert metered.continue_rebuild(max_seconds=0.0) and not metered.is_full and not metered.is_rebuilding
    assert metered._matcher.num_tokens == 2 and metered.max_states == 2 * FIRST_MAX_LEXER_STATES  # type: ignore[attr-defined]
    metered.compute_bitmask()  # asked again, of the rebuilt matcher
    assert not metered.is_error() and metered.take_rebuild_seconds() >= 0.0


def test_a_deferring_matcher_that_fills_taking_a_token_rebuilds_at_once() -> None:
    # The token is the answer's: its taking is never put off (a mask has explored its states already).
    class FillingOnTake(_FillingMatcher):
        REPLAY_CPU_S = 0.0

        def compute_bitmask(self) -> bytes:
            return b"\xff" * 4

        def consume_token(self, token_id: int) -> bool:
            if self.num_tokens == 2 and self.max_states <= FIRST_MAX_LEXER_STATES:
                self.error = f"too many states: {self.max_states} >= {self.max_states}"
                return False
            return super().consume_token(token_id)

    metered = MeteredMatcher(FillingOnTake, 50_000)
    metered.defers_rebuilds = True
    for token_id in (1, 2, 3):
        metered.compute_bitmask()
        metered.consume_token(token_id)
    assert metered.max_states > FIRST_MAX_LEXER_STATES and not metered.is_full and not metered.is_error()
