"""The grammar compiler: what it builds for a request's structured output, and what it refuses."""

from __future__ import annotations

import itertools
import json
import string
import threading
from pathlib import Path

import pytest
import tokenizers

from tandem.client.errors import InvalidArgument
from tandem.decoder.engine.params import StructuredOutput
from tandem.decoder.engine.sampling.structured import MAX_SOURCE_CHARS, GrammarCompiler


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path) -> GrammarCompiler:
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    return GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), eos_token_ids=(eos,))


@pytest.fixture(scope="module")
def eos(compiler: GrammarCompiler) -> int:
    (token_id,) = compiler.constraint(StructuredOutput("grammar", 'start: "a"')).eos_token_ids
    return token_id


def _names() -> list[str]:
    letters = string.ascii_lowercase
    return [n for k in (1, 2, 3) for n in map("".join, itertools.product(letters, repeat=k)) if n != "start"]


def _deepest_lark_chain() -> str:
    """Rules that each name the next, as many as fit in MAX_SOURCE_CHARS (5,580)."""
    names, lines = _names(), ["start:a"]
    while len("\n".join(lines)) + 20 < MAX_SOURCE_CHARS:
        lines.append(f'{names[len(lines) - 1]}:"a" {names[len(lines)]}')
    lines.append(f'{names[len(lines) - 1]}:"a"')
    return "\n".join(lines)


def _deepest_ref_chain() -> str:
    """A JSON schema whose $defs each hold an array of the next, as many as fit (1,716)."""
    names, defs = _names(), {}
    while len(json.dumps(defs, separators=(",", ":"))) < MAX_SOURCE_CHARS - 100:
        defs[names[len(defs)]] = {"items": {"$ref": f"#/$defs/{names[len(defs) + 1]}"}}
    defs[names[len(defs)]] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/a", "$defs": defs}, separators=(",", ":"))


@pytest.mark.parametrize(
    ("kind", "source"), [("grammar", _deepest_lark_chain()), ("json_schema", _deepest_ref_chain())]
)
def test_the_deepest_source_within_the_size_limit_compiles_without_overflowing_the_stack(
    compiler: GrammarCompiler, kind: str, source: str
) -> None:
    # Before COMPILE_STACK_BYTES, llguidance's recursion overflowed the builder thread's 8 MiB stack
    # and this test (like the decoder) died of SIGSEGV.
    assert len(source) <= MAX_SOURCE_CHARS
    before = threading.active_count()
    constraint = compiler.constraint(StructuredOutput(kind, source))
    assert not constraint.is_error and constraint.allowed().any()
    assert threading.active_count() == before  # the compiling thread ended with its work


def test_a_refusal_on_the_compiling_thread_reaches_the_caller_naming_the_field(
    compiler: GrammarCompiler,
) -> None:
    with pytest.raises(InvalidArgument) as error:
        compiler.constraint(StructuredOutput("regex", "(a)\\1"))
    assert error.value.field == "structured.regex" and "backreferences" in str(error.value)


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
