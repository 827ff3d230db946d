"""The grammar compiler: what it builds for a request's structured output, and what it refuses."""

from __future__ import annotations

import itertools
import json
import string
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import tokenizers
import torch

from services.decoder.tests.engine.engine_helpers import RecordingMatcher
from tandem.client.errors import InvalidArgument, ResourceExhausted
from tandem.decoder.engine.params import StructuredOutput
from tandem.decoder.engine.sampling import structured
from tandem.decoder.engine.sampling.constraint import Constraint
from tandem.decoder.engine.sampling.deep_stack import on_deep_stack
from tandem.decoder.engine.sampling.grammar_limits import MAX_LEXER_FUEL, MAX_LEXER_STATES
from tandem.decoder.engine.sampling.grammar_memory import MIN_MATCHER_BYTES, GrammarMemoryBudget
from tandem.decoder.engine.sampling.structured import MAX_SCHEMA_DEPTH, MAX_SOURCE_CHARS, GrammarCompiler


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


def test_a_schema_of_true_is_any_json_value_as_the_empty_schema_is(compiler: GrammarCompiler) -> None:
    # JSON Schema's `true` accepts every value; llguidance refused it ("Expecting object schema").
    anything = compiler.constraint(StructuredOutput("json_schema", "true"))
    empty = compiler.constraint(StructuredOutput("json_schema", "{}"))
    assert torch.equal(anything.allowed(), empty.allowed()) and anything.allowed().sum() > 1


def test_json_that_is_no_schema_is_refused_naming_what_a_schema_is(compiler: GrammarCompiler) -> None:
    # It said "a JSON schema object", though true is taken as well.
    for source in ("5", '"{}"', "[{}]", "null"):
        with pytest.raises(
            InvalidArgument, match=r"must be a JSON schema \(an object or a boolean\)"
        ) as error:
            compiler.constraint(StructuredOutput("json_schema", source))
        assert error.value.field == "structured.json_schema"


def test_a_schema_of_false_is_refused_in_our_words(compiler: GrammarCompiler) -> None:
    with pytest.raises(InvalidArgument) as error:
        compiler.constraint(StructuredOutput("json_schema", "false"))
    assert error.value.field == "structured.json_schema"
    assert "false, a schema no JSON value satisfies" in str(error.value)


def _nested(depth: int, shape: str) -> str:
    """A schema whose objects and arrays nest `depth` levels: `items` one level each, `properties` two."""
    schema: dict = {"type": "integer"}
    levels = 1
    while levels + (2 if shape == "properties" else 1) <= depth:
        if shape == "properties":
            schema, levels = {"type": "object", "properties": {"a": schema}}, levels + 2
        else:
            schema, levels = {"type": "array", "items": schema}, levels + 1
    if levels < depth:  # an odd depth of properties: one array more
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


@pytest.mark.parametrize("shape", ["items", "properties"])
def test_a_schema_nested_past_the_bound_is_refused_naming_it_and_one_at_the_bound_compiles(
    compiler: GrammarCompiler, shape: str
) -> None:
    deepest = compiler.constraint(StructuredOutput("json_schema", _nested(MAX_SCHEMA_DEPTH, shape)))
    assert deepest.allowed().any()
    with pytest.raises(InvalidArgument) as error:
        compiler.constraint(StructuredOutput("json_schema", _nested(MAX_SCHEMA_DEPTH + 1, shape)))
    assert error.value.field == "structured.json_schema"
    assert f"nests {MAX_SCHEMA_DEPTH + 1} levels of objects and arrays, over the {MAX_SCHEMA_DEPTH}" in str(
        error.value
    )


def test_a_duplicate_key_nested_past_the_bound_is_refused_whichever_of_its_values_comes_first(
    compiler: GrammarCompiler,
) -> None:
    # json.loads keeps a duplicate key's last value, but llguidance's JSON parser counts the levels of
    # every value it reads: measured on the last, a first one of 150 levels passed and llguidance
    # refused it in its own words ("recursion limit exceeded at line 1 column 3430").
    deep, shallow = _nested(150, "items"), '{"type": "integer"}'
    for first, last in ((deep, shallow), (shallow, deep)):
        source = f'{{"type": "array", "items": {first}, "items": {last}}}'
        with pytest.raises(InvalidArgument) as error:
            compiler.constraint(StructuredOutput("json_schema", source))
        assert error.value.field == "structured.json_schema"
        assert f"nests 151 levels of objects and arrays, over the {MAX_SCHEMA_DEPTH}" in str(error.value)


def test_the_nesting_bound_is_the_deepest_schema_llguidance_itself_reads(compiler: GrammarCompiler) -> None:
    # The bound is honest: one level more fails inside llguidance, in words that name no limit. Should
    # an upgrade read deeper, this fails and MAX_SCHEMA_DEPTH may rise.
    import llguidance

    def llguidance_reads(source: str) -> bool:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source)
        except ValueError:
            return False
        return not llguidance.LLMatcher.validate_grammar_with_warnings(grammar, compiler._tokenizer)[0]

    assert on_deep_stack(lambda: llguidance_reads(_nested(MAX_SCHEMA_DEPTH, "items")))
    assert not on_deep_stack(lambda: llguidance_reads(_nested(MAX_SCHEMA_DEPTH + 1, "items")))


def test_an_empty_choice_is_refused_naming_its_index(compiler: GrammarCompiler) -> None:
    with pytest.raises(InvalidArgument) as refused:
        compiler.constraint(StructuredOutput("choice", ("a", "b", "c", "")))
    assert (refused.value.field, refused.value.description) == ("structured.choice[3]", "must not be empty")


@pytest.mark.parametrize("is_cached", [False, True], ids=["first-build", "cache-hit"])
def test_a_requests_first_mask_is_computed_once_on_its_building_thread_and_its_first_step_takes_it(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch, is_cached: bool
) -> None:
    # A fresh matcher's lexer is cold: its first mask in the engine's step held up the batch
    # (a{300}{100}: 20-28 ms; 64 requests of [\w .]{1,1000} took Qwen3's first step from 4 to 95 ms),
    # so it is computed before the request is queued, off the engine thread, on a first build and on
    # a verdict's cache hit alike. Nothing is taken between, so the first step takes that mask: it
    # computed it again (a{300}{100}: 4-6 ms of the step's grammar CPU with this tokenizer).
    matchers: list[RecordingMatcher] = []
    build = compiler._matcher
    monkeypatch.setattr(
        compiler,
        "_matcher",
        lambda verdict, *limit: matchers.append(RecordingMatcher(build(verdict, *limit))) or matchers[-1],
    )
    spec = StructuredOutput("regex", f"[a-z]{{1,7}} {'repeated' if is_cached else 'once'}")
    if is_cached:
        compiler.constraint(spec)  # judged and cached: the verdict
    constraint = compiler.constraint(spec)
    matcher = constraint._matcher._matcher  # type: ignore[attr-defined]  # llguidance's, in its metered
    assert isinstance(matcher, RecordingMatcher) and matcher.threads == ["tandem-grammar-compile"]
    first = constraint.allowed()
    assert matcher.threads == ["tandem-grammar-compile"]  # taken, not computed
    # The mask the matcher itself computes in that state.
    assert torch.equal(
        first,
        Constraint(
            matcher._matcher, compiler.vocab_size, max_token_cpu_seconds=compiler.max_token_cpu_seconds
        ).allowed(),
    )
    constraint.accept(int(first.nonzero()[0]))
    constraint.allowed()  # the next state's: computed here
    assert matcher.threads == ["tandem-grammar-compile", threading.current_thread().name]


@pytest.mark.parametrize(
    ("kind", "source"),
    [
        ("regex", "a{1000}{1000}"),
        ("grammar", "start: /a{1000}{1000}/"),
        ("json_schema", '{"type": "string", "pattern": "^a{1000}{1000}$"}'),
    ],
)
def test_a_grammar_that_outruns_the_lexer_fuel_is_refused_when_built_naming_the_field_and_the_limit(
    compiler: GrammarCompiler, kind: str, source: str
) -> None:
    # With llguidance's default fuel these 13 bytes cost 0.8-2.5 s to build, and the exhausted fuel
    # showed only at the first sampled token: INVALID_ARGUMENT mid-stream, seconds later. Bounded in
    # this process's CPU time (the build runs on a thread of its own), which a busy machine does not
    # stretch: the wall clock read 1.01 s with seven other test runs on two cores.
    started = time.process_time()
    with pytest.raises(InvalidArgument) as refused:
        compiler.constraint(StructuredOutput(kind, source))
    assert refused.value.field == f"structured.{kind}"
    assert f"more than the {MAX_LEXER_FUEL:,} steps" in refused.value.description
    assert "lexer fuel" in refused.value.description
    assert time.process_time() - started < 1.0


def test_alternatives_past_the_parsers_row_bound_are_refused_when_built_only_at_the_first_token_tried(
    compiler: GrammarCompiler,
) -> None:
    # The build takes one token its first mask allows, the lowest ID ("0" here): where that token
    # opens more alternatives than the parser follows (2,000), the grammar is refused before it runs.
    alternatives = " | ".join(f'"0{i}"' for i in range(2100))
    with pytest.raises(InvalidArgument) as refused:
        compiler.constraint(StructuredOutput("grammar", f"start: {alternatives}"))
    assert refused.value.field == "structured.grammar"
    assert refused.value.description.startswith("offers more alternatives at one point than the parser")
    # Where another first token opens them ("1"), the build passes, as trying every token would cost
    # a consume per token of the vocabulary; sampled, that token fails the request naming the field.
    alternatives = " | ".join(f'"1{i}"' for i in range(2100))
    constraint = compiler.constraint(StructuredOutput("grammar", f'start: "0" | {alternatives}'))
    _, one = constraint.allowed().nonzero().flatten().tolist()  # "0", then "1"
    constraint.accept(one)
    error = constraint.error()
    assert error is not None and error.field == "structured.grammar"
    assert f"failed after 0 tokens of the answer: it refused the sampled token {one}: it offers more " in (
        error.description
    )


def test_a_self_requiring_property_is_refused_when_built_as_admitting_no_finite_answer(
    compiler: GrammarCompiler,
) -> None:
    # It said "Too many items (limit 50000; ff_tokens)" after the first sampled token.
    node = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    with pytest.raises(InvalidArgument) as refused:
        compiler.constraint(
            StructuredOutput("json_schema", json.dumps({"$defs": {"n": node}, "$ref": "#/$defs/n"}))
        )
    assert refused.value.field == "structured.json_schema"
    assert refused.value.description.startswith("admits no finite answer")


def test_a_grammar_is_judged_once_and_each_request_builds_its_own_matcher(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    judged: list[StructuredOutput] = []
    judge = compiler._judged
    monkeypatch.setattr(compiler, "_judged", lambda spec: judged.append(spec) or judge(spec))
    spec = StructuredOutput("regex", "(ab|cd){1,40}")
    first, second = compiler.constraint(spec), compiler.constraint(spec)
    assert judged == [spec]  # the second request was not judged again
    assert first._matcher is not second._matcher
    (token,) = [t for t in range(compiler.vocab_size) if first.allowed()[t]][:1]
    before = second.allowed()
    first.accept(token)
    assert torch.equal(second.allowed(), before) and first.error() is None


def test_a_refusal_is_kept_so_a_repeated_hostile_grammar_costs_no_second_build(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    judged: list[StructuredOutput] = []
    judge = compiler._judged
    monkeypatch.setattr(compiler, "_judged", lambda spec: judged.append(spec) or judge(spec))
    spec = StructuredOutput("regex", "b{1000}{1000}")
    for _ in range(3):
        with pytest.raises(InvalidArgument, match="lexer fuel"):
            compiler.constraint(spec)
    assert judged == [spec]


def test_the_verdict_cache_is_bounded_by_the_bytes_its_sources_hold_as_by_their_count(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 256 verdicts of the largest sources in 4-byte characters held about 133 MB: the oldest go first.
    monkeypatch.setattr(structured, "MAX_CACHE_BYTES", 3 * 4 * MAX_SOURCE_CHARS)
    specs = [
        StructuredOutput("json_schema", f"{i}" + "\U0001f600" * (MAX_SOURCE_CHARS - 1)) for i in range(5)
    ]
    for spec in specs:
        with pytest.raises(InvalidArgument, match="is not valid JSON"):
            compiler.constraint(spec)
    assert list(compiler._cache) == specs[-2:]  # two of 256 KB sources, and their short refusals
    assert compiler._cache_bytes == sum(structured._held_bytes(s, compiler._cache[s]) for s in specs[-2:])
    compiler._keep(specs[-1], compiler._cache[specs[-1]])  # kept again (two judged at once): once
    assert compiler._cache_bytes == sum(structured._held_bytes(s, compiler._cache[s]) for s in specs[-2:])


def test_a_request_that_exhausts_its_lexer_states_does_not_fail_the_next_of_its_grammar(
    compiler: GrammarCompiler, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # llguidance's deep_copy shares the lexer: copies of one cached matcher pooled their states, and
    # once one request exhausted them every later request of that grammar failed at its first token.
    # A pool of 1,000 states (50,000 served) is exhausted by this regex within 8 letters.
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    letters = [tokenizer.token_to_id(letter) for letter in string.ascii_lowercase]
    regex = r"[a-z]*(a[a-z]{9}b|c[a-z]{9}d|e[a-z]{9}f|g[a-z]{9}h|i[a-z]{9}j)[a-z]*"

    monkeypatch.setattr(structured, "MAX_LEXER_STATES", 1000)
    monkeypatch.setattr(compiler, "_cache", OrderedDict())
    spec = StructuredOutput("regex", regex)
    exhausted = compiler.constraint(spec)
    for token_id in itertools.islice(itertools.cycle(letters), 100):
        exhausted.allowed()
        exhausted.accept(token_id)
        if exhausted.error() is not None:
            break
    assert "lexer states" in exhausted.error().description  # type: ignore[union-attr]
    for _ in range(3):
        after = compiler.constraint(spec)
        after.allowed()
        after.accept(letters[0])
        assert after.error() is None


def test_a_schema_that_is_only_a_reference_to_itself_admits_no_answer_in_words_without_markers(
    compiler: GrammarCompiler,
) -> None:
    source = json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
    with pytest.raises(InvalidArgument) as error:
        compiler.constraint(StructuredOutput("json_schema", source))
    assert "admits no answer: no text can begin it" in error.value.description
    assert "<non-verbose/>" not in error.value.description


def test_a_grammar_that_makes_llguidance_panic_is_refused_in_its_first_line_without_the_backtrace(
    compiler: GrammarCompiler, caplog: pytest.LogCaptureFixture
) -> None:
    # llguidance 1.9.1 panics on this grammar's first mask; its error held the panic's backtrace
    # (frames, and the paths llguidance was built at), which reached the client.
    source = 'start: w "x"\nw[lazy]: /[\\w .]{0,1000}/\n'
    with pytest.raises(InvalidArgument) as error:
        compiler.constraint(StructuredOutput("grammar", source))
    assert error.value.field == "structured.grammar"
    assert error.value.description == (
        "admits no answer: no text can begin it (panic: assertion failed: !state.has_lowest_match())"
    )
    assert "backtrace" in caplog.text  # logged for the operator


def test_a_schema_past_llguidances_own_size_bound_is_refused_naming_the_bound_and_what_multiplies(
    compiler: GrammarCompiler,
) -> None:
    # 4 allOf of 10 anyOf each, 3.5 KB: llguidance said only "schema too large".
    def anyof(tag: str) -> dict:
        return {
            "anyOf": [
                {"properties": {f"{tag}{i}": {"type": "integer"}}, "required": [f"{tag}{i}"]}
                for i in range(10)
            ]
        }

    source = json.dumps({"allOf": [anyof(f"t{depth}_") for depth in range(4)]})
    with pytest.raises(InvalidArgument) as error:
        compiler.constraint(StructuredOutput("json_schema", source))
    assert error.value.field == "structured.json_schema"
    assert error.value.description.startswith("is too large:")
    assert "JSON schema compiler" in error.value.description and "allOf of anyOf" in error.value.description


def test_a_matchers_lexer_states_are_bounded_far_below_llguidances_default(compiler: GrammarCompiler) -> None:
    # States are built as an answer goes on and kept until the request ends, charged as they grow
    # (grammar_growth). llguidance's default is 250,000.
    metered = compiler.constraint(StructuredOutput("regex", "a+")).metered
    assert metered is not None and metered._max_lexer_states == MAX_LEXER_STATES <= 50_000


def test_each_constraint_is_charged_to_its_caller_until_it_is_collected(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiler, "memory", GrammarMemoryBudget())
    first = compiler.constraint(StructuredOutput("regex", "a+"), caller="a")
    second = compiler.constraint(StructuredOutput("regex", "a+"), caller="b")
    assert compiler.memory.held("a") == first.memory_bytes >= MIN_MATCHER_BYTES
    del first  # its request ended, whichever way: nothing else holds it
    assert (compiler.memory.held("a"), compiler.memory.held()) == (0, second.memory_bytes)


def test_a_constraint_past_its_callers_memory_limit_is_refused_naming_its_field_and_the_limit(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 2 * MIN_MATCHER_BYTES - 1  # one ordinary matcher, not two
    monkeypatch.setattr(compiler, "memory", GrammarMemoryBudget(max_bytes_per_caller=limit))
    held = compiler.constraint(StructuredOutput("regex", "a+"), caller="a")
    with pytest.raises(ResourceExhausted, match=r"^structured\.regex: .*the limit is 4 MiB per caller"):
        compiler.constraint(StructuredOutput("regex", "a+"), caller="a")
    compiler.constraint(StructuredOutput("regex", "a+"), caller="b")  # another caller's goes on
    assert compiler.memory.held("a") == held.memory_bytes
