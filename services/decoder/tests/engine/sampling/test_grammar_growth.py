"""A matcher's growth while decoding: its lexer states are charged a tranche at a time as they fill, its
masks what an unmetered matcher's are, and a growth the budget refuses fails its request alone, naming
its field and the limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
import torch

from tandem.client.errors import ResourceExhausted
from tandem.decoder.engine.params import StructuredOutput
from tandem.decoder.engine.sampling.grammar_growth import (
    BYTES_PER_LEXER_STATE,
    FIRST_MAX_LEXER_STATES,
    growth_bytes,
)
from tandem.decoder.engine.sampling.grammar_memory import MIB, GrammarMemoryBudget
from tandem.decoder.engine.sampling.structured import Constraint, GrammarCompiler

# Every character a new lexer state, and each mask explores the tokens that go on from it: about 60
# states a token of one character with SmolLM2's vocabulary, past the first tranche within 20.
GROWING = StructuredOutput("regex", r"[\w .]{1,1000}")
LIMIT_S = 10.0  # no test here is about CPU time


@pytest.fixture
def compiler(tiny_model_dir: Path) -> GrammarCompiler:
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


def test_growth_is_charged_a_kibibyte_a_state_past_the_first_tranche_the_floor_covers() -> None:
    assert growth_bytes(FIRST_MAX_LEXER_STATES) == 0 == growth_bytes(10)
    assert growth_bytes(4 * FIRST_MAX_LEXER_STATES) == 3 * FIRST_MAX_LEXER_STATES * BYTES_PER_LEXER_STATE


def test_an_ordinary_grammar_never_leaves_its_first_tranche(compiler: GrammarCompiler) -> None:
    constraint = compiler.constraint(StructuredOutput("json_object", ""))
    _decode(constraint, [int(constraint.allowed().nonzero()[0])])
    assert constraint.metered is not None and constraint.metered.max_states == FIRST_MAX_LEXER_STATES
    assert constraint.metered.charged_bytes == 0


def test_a_growing_matcher_is_charged_as_its_states_fill_and_masks_as_an_unmetered_one(
    compiler: GrammarCompiler, answer: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiler, "memory", GrammarMemoryBudget())
    constraint = compiler.constraint(GROWING, caller="a")
    built = constraint.memory_bytes
    tokens = answer[:120]
    masks = _decode(constraint, tokens)
    metered = constraint.metered
    assert metered is not None and metered.max_states > FIRST_MAX_LEXER_STATES  # built again, larger
    assert constraint.error() is None and len(masks) == len(tokens)
    assert constraint.memory_bytes == built + growth_bytes(metered.max_states) == compiler.memory.held("a")
    # The reference: one matcher of the served limit from the start, never built again.
    reference = Constraint(
        compiler._matcher(compiler._cache[GROWING]), compiler.vocab_size, max_token_cpu_seconds=LIMIT_S
    )
    assert all(torch.equal(a, b) for a, b in zip(masks, _decode(reference, tokens), strict=True))
    del constraint, metered  # its request ended: every tranche given back with its build's charge
    assert compiler.memory.held() == 0


def test_a_proposal_rolled_back_across_a_rebuild_leaves_the_state_where_it_was(
    compiler: GrammarCompiler, answer: list[int]
) -> None:
    constraint = compiler.constraint(GROWING)
    tokens = answer[:60]
    _decode(constraint, tokens[:10])
    metered = constraint.metered
    assert metered is not None and metered.max_states == FIRST_MAX_LEXER_STATES
    constraint.masks_along(tokens[10:])  # the states fill on the way, and are rolled back after
    assert metered.max_states > FIRST_MAX_LEXER_STATES
    reference = compiler.constraint(GROWING)
    _decode(reference, tokens[:10])
    assert torch.equal(constraint.allowed(), reference.allowed())


def test_a_growth_past_its_callers_limit_fails_that_request_naming_its_field_and_the_limit(
    compiler: GrammarCompiler, answer: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiler, "memory", GrammarMemoryBudget(max_bytes_per_caller=8 * MIB))
    growing = compiler.constraint(GROWING, caller="a")
    neighbour = compiler.constraint(GROWING, caller="b")
    tokens = answer[:400]
    masks = _decode(growing, tokens)
    error = growing.error()
    assert isinstance(error, ResourceExhausted) and len(masks) < len(tokens)
    assert str(error).startswith(
        f"structured.regex: the grammar's matcher grew while decoding, after {len(masks)} tokens of the "
        "answer past "
    )
    assert "the limit is 8 MiB per caller" in str(error)
    assert compiler.memory.held("a") == growing.memory_bytes <= 8 * MIB
    # Another caller's request of the same grammar goes on within its own limit (half the answer).
    assert len(_decode(neighbour, tokens[: len(masks) // 2])) == len(masks) // 2
    assert neighbour.error() is None
