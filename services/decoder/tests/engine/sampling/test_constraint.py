"""A request's grammar state: the tokens it allows, the tokens it takes, and why it fails."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import tokenizers
import torch

from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.params import StructuredOutput
from tandem.decoder.engine.sampling.constraint import NUM_MASKS_AVERAGED, Constraint
from tandem.decoder.engine.sampling.deep_stack import on_deep_stack
from tandem.decoder.engine.sampling.structured import GrammarCompiler

SERVED_LIMIT_S = EngineConfig.max_grammar_cpu_ms_per_token / 1000  # the flag's default, in seconds


def test_the_eos_token_sampled_where_the_grammar_takes_it_as_text_is_an_error_never_an_answer(
    compiler: GrammarCompiler, eos: int
) -> None:
    # The grammar allows EOS here as text, so the mask lets it through; sampled, it ends the answer
    # with FINISH_REASON_EOS, which then would not parse (it had ended as an empty answer).
    constraint = compiler.constraint(StructuredOutput("grammar", f'start: <[{eos}]> "a"'))
    assert constraint.allowed()[eos]
    constraint.accept(eos)
    error = constraint.error()
    assert error is not None and error.field == "structured.grammar"
    assert f"end-of-sequence token {eos} as text, after 0 tokens" in error.description


def test_the_eos_token_where_the_grammar_ends_is_its_end_and_no_error(
    compiler: GrammarCompiler, eos: int
) -> None:
    constraint = compiler.constraint(StructuredOutput("regex", "a"))
    (a,) = [t for t in range(compiler.vocab_size) if constraint.allowed()[t]]
    constraint.accept(a)
    assert constraint.allowed()[eos]
    constraint.accept(eos)
    assert constraint.error() is None


def test_a_refused_token_fails_naming_the_field_the_token_and_the_tokens_before_it_in_our_words(
    compiler: GrammarCompiler,
) -> None:
    constraint = compiler.constraint(StructuredOutput("regex", "ab"))
    (ab,) = [t for t in range(compiler.vocab_size) if constraint.allowed()[t]]
    constraint.accept(ab)
    refused = next(t for t in range(compiler.vocab_size) if not constraint.allowed()[t])
    constraint.accept(refused)
    error = constraint.error()
    assert error is not None and error.field == "structured.regex"
    assert f"failed after 1 tokens of the answer: it refused the sampled token {refused}" in error.description
    assert "<non-verbose/>" not in error.description and "no error message" not in error.description


class _FailsAtNextMask:
    """A matcher whose next mask fails as llguidance's lexer does past its limits."""

    def __init__(self, matcher: object) -> None:
        self._matcher = matcher
        self.failed = False

    def compute_bitmask(self) -> bytes:
        self.failed = True
        return self._matcher.compute_bitmask()  # type: ignore[attr-defined]

    def is_error(self) -> bool:
        return self.failed or bool(self._matcher.is_error())  # type: ignore[attr-defined]

    def get_error(self) -> str:
        return "lexer error: too many expressions constructed"

    def __getattr__(self, name: str) -> object:
        return getattr(self._matcher, name)


def test_a_grammar_whose_mask_fails_counts_only_the_tokens_sent_before_that_mask(
    compiler: GrammarCompiler,
) -> None:
    # The step still samples from the failed mask and accepts its token, which is never sent: the
    # message said one token more than the caller had (11 sent, "after 12 tokens").
    constraint = compiler.constraint(StructuredOutput("regex", "a+"))
    a = next(t for t in range(compiler.vocab_size) if constraint.allowed()[t])
    constraint.accept(a)
    constraint.allowed()
    constraint.accept(a)
    constraint._matcher = _FailsAtNextMask(constraint._matcher)  # type: ignore[assignment]
    constraint.allowed()
    constraint.accept(a)
    error = constraint.error()
    assert error is not None and error.field == "structured.regex"
    assert "failed after 2 tokens of the answer: it stopped matching" in error.description


@pytest.mark.parametrize("source", ["ab", "a+"], ids=["ends-by-itself", "ends-at-eos"])
def test_masks_along_a_proposal_past_the_grammars_end_leave_the_state_where_it_was(
    compiler: GrammarCompiler, eos: int, source: str
) -> None:
    # A proposal may hold the answer's end and then EOS (prompt lookup copies a chat's end marker):
    # llguidance records nothing taken after its grammar stopped, so rolling back by the proposal's
    # length undid the answer's own tokens and the token verified next was refused.
    constraint = compiler.constraint(StructuredOutput("regex", source))
    (first,) = [t for t in range(compiler.vocab_size) if constraint.allowed()[t]][:1]
    before = constraint.allowed()
    masks = constraint.masks_along([first, eos, eos])
    assert len(masks) == 4 and bool(masks[-1][eos])
    assert torch.equal(constraint.allowed(), before)
    constraint.accept(first)
    assert constraint.error() is None


AMBIGUOUS = 'start: s\ns: s s s | s s | "a"'  # every split of "aaa..." is a parse: Earley keeps them all


def _a(tiny_model_dir: Path) -> int:
    return tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).token_to_id("a")


@pytest.mark.parametrize("num_proposed", [0, 4], ids=["plain", "speculating"])
def test_an_ambiguous_grammar_fails_the_request_once_one_token_costs_more_cpu_than_the_limit(
    compiler: GrammarCompiler, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, num_proposed: int
) -> None:
    # The parse of this grammar's answer costs more with every token (with SmolLM2's vocabulary a
    # mask took 5 ms at 100 tokens and over a second at 900), and each mask holds up the whole batch's
    # step. A limit of 2 ms, not the served 50 ms, so the growth passes it within a second here.
    monkeypatch.setattr(compiler, "max_token_cpu_seconds", 0.002)
    a = _a(tiny_model_dir)
    constraint = compiler.constraint(StructuredOutput("grammar", AMBIGUOUS))
    while constraint.error() is None and constraint.num_accepted < 400:
        if num_proposed:  # as a speculating step: the proposal checked, each verifying row masked
            assert constraint.valid_prefix([a] * num_proposed) == num_proposed
            assert all(mask[a] for mask in constraint.masks_along([a] * num_proposed))
        else:
            assert constraint.allowed()[a]
        constraint.accept(a)
    error = constraint.error()
    assert error is not None and error.field == "structured.grammar", error
    assert (
        "ms of CPU per token (a mask, and taking the token) on average over its last 8 masks"
        in error.description
    )
    assert "over the limit of 2 ms" in error.description
    # Long before llguidance's own limit on the parse (2,000 items in a row, at about 400 tokens)
    assert 20 < constraint.num_accepted < 300, error.description


def test_a_long_unambiguous_answer_stays_far_below_the_limit_per_token(
    compiler: GrammarCompiler, tiny_model_dir: Path
) -> None:
    # The ambiguous grammar's language with one parse per answer: 2,000 tokens, none near the served
    # limit (0.3-0.4 ms of CPU at most, with this vocabulary and SmolLM2's). Left-recursive: a
    # right-recursive rule's Earley rows grow by an item a token, to llguidance's 2,000 at 1,997.
    a = _a(tiny_model_dir)
    constraint = compiler.constraint(StructuredOutput("grammar", 'start: s\ns: s "a" | "a"'))
    for _ in range(2000):
        assert constraint.allowed()[a]
        constraint.accept(a)
    assert constraint.error() is None and constraint.max_token_cpu_seconds == SERVED_LIMIT_S


def test_matching_thousands_of_nesting_levels_needs_no_deep_stack(
    compiler: GrammarCompiler, tiny_model_dir: Path
) -> None:
    # Compiling recurses per rule (COMPILE_STACK_BYTES), matching does not per level of the answer:
    # 3,000 open brackets and 600 nested JSON objects on a 1 MiB stack, an eighth of the default 8 MiB
    # that the engine's mask thread and the engine thread run with (a recursion would die of SIGSEGV).
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    nested = [
        (StructuredOutput("grammar", 'start: a\na: "(" a ")" | "x"'), "(" * 3000),
        (StructuredOutput("json_object", ""), '{"a":' * 600),
    ]
    constraints = [compiler.constraint(spec) for spec, _ in nested]

    def answer() -> None:
        for constraint, (_, text) in zip(constraints, nested, strict=True):
            for token_id in tokenizer.encode(text).ids:
                assert constraint.allowed()[token_id]
                constraint.accept(token_id)
            assert constraint.error() is None and constraint.allowed().any()

    on_deep_stack(answer, stack_bytes=1024 * 1024)


class _BurningMatcher:
    """A matcher whose masks burn the CPU time a test asks for, one after another."""

    def __init__(self, mask_seconds: list[float]) -> None:
        self.mask_seconds = mask_seconds

    def compute_bitmask(self) -> bytes:
        end = time.thread_time() + self.mask_seconds.pop(0)
        while time.thread_time() < end:
            pass
        return bytes(4)

    def consume_token(self, token_id: int) -> None:
        pass

    def is_stopped(self) -> bool:
        return False

    def is_error(self) -> bool:
        return False


def _answer(mask_seconds: list[float]) -> Constraint:
    """A constraint (limit: 5 ms on average) after one mask and one token per entry, or its error."""
    constraint = Constraint(
        _BurningMatcher(list(mask_seconds)), 32, "structured.grammar", max_token_cpu_seconds=0.005
    )
    while constraint.error() is None and constraint.num_accepted < len(mask_seconds):
        constraint.allowed()
        constraint.accept(1)
    return constraint


def test_one_dear_mask_passes_and_dear_masks_that_stay_fail_the_request() -> None:
    # llguidance's lexer may spend its fuel (about 150 ms) once on a legitimate grammar's new state,
    # where an ambiguous grammar's cost stays: one mask of 4 times the limit among cheap ones passes,
    # masks of 1.6 times it, one after another, fail the request within the average's 8 masks.
    assert _answer([0.02] + [0.0] * 15).error() is None
    stays = _answer([0.008] * 16)
    error = stays.error()
    assert error is not None and "over the limit of 5 ms" in error.description
    assert stays.num_accepted <= 6  # 6 masks of 8 ms pass 8 x 5 ms


def test_a_given_first_mask_costs_the_averages_nothing_and_every_mask_computed_after_it_counts() -> None:
    # The first mask, the lexer's warm-up (up to about 150 ms), is computed where the grammar is built
    # and handed to the constraint: it opens its entry at what the engine pays for it, nothing. The
    # step's budget left the first entry out of its average as that warm-up; now it is the engine's
    # cheap work (the mask given, the first token taken), and every mask computed after it counts.
    computed = [0.004] * 7
    constraint = Constraint(
        _BurningMatcher(list(computed)), 32, max_token_cpu_seconds=0.05, first_bitmask=bytes(4)
    )
    for _ in range(1 + len(computed)):
        constraint.allowed()
        constraint.accept(1)
    assert constraint._matcher.mask_seconds == []  # type: ignore[attr-defined]  # 7 masks computed, not 8
    assert constraint._recent_seconds[0] < 0.001  # the given one
    assert constraint.mask_seconds >= sum(computed) / NUM_MASKS_AVERAGED
