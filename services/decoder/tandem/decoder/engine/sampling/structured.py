"""Structured output: a grammar constrains which tokens a request may sample, so its answer parses.

llguidance does the grammar work (JSON schema, regular expressions, Lark grammars; a choice among
strings is a regular expression of them). Chosen over xgrammar by measurement (PERFORMANCE.md): both
compile a schema in about a millisecond and mask in microseconds; llguidance builds its tokenizer from
our tokenizer's JSON and bounds its work with parser limits, and needs no torch of its own. One
`GrammarCompiler` per engine holds the tokenizer in llguidance's form (built once: about 0.3 s for a
49k vocabulary) and a cache of verdicts by content: a grammar's compiled text where it was accepted,
its refusal where not, so a repeated hostile grammar is refused without a second build. Each request
gets its own `Constraint` (constraint.py) on a matcher built for it alone (the grammar's state after
the tokens sampled so far), charged against the engine's and its caller's matcher memory while it lives
(grammar_memory.py). Not a copy of a cached matcher: llguidance's `deep_copy` shares the lexer, so every
request of one grammar added its lexer states to one pool, the first to exhaust it ("needs more lexer
states than allowed") failed every later request of that grammar at its first token until restart,
and each cached regex kept up to about 97 MB of states. A build costs up to MAX_LEXER_FUEL's bound
(0.1-0.3 s at worst, about a millisecond for a typical schema). Compiling, the first mask and a first
token taken on a matcher of its own (where llguidance reports what its first mask ran out of) run
before the request is queued, under llguidance's parser limits, so a hostile grammar costs its caller
an INVALID_ARGUMENT and nothing else; the request's first step takes that first mask rather than
computing it again (nothing is taken between). They run on a thread of their own with a deep stack
(deep_stack.py says why). Each step the constraint's allowed tokens mask the request's logits
(the model's EOS only where the grammar may end); after the step it takes the sampled token.

NOTE: the grammar's work per token is bounded by CPU time, not only by llguidance's limits. Its
Earley parser pays, per token, for every parse of the answer so far still open, so an ambiguous
grammar's (`s: s s | "a"`) grows with the answer: with SmolLM2's vocabulary a mask took 5 ms at 100
tokens, 0.1 s at 600 and 0.5 s of CPU at 933 (1.8 s of wall time on a busy machine), 137 s of CPU in
all before llguidance's 2,000 items in a row stopped it at 999 tokens, and every step of the batch
waits for each mask. llguidance's per-step limits count the items it creates, not the rows each
completion scans, so they did not trip. Where the grammar's work for its last NUM_MASKS_AVERAGED
masks (each mask, and taking or checking the token after it) cost over the engine's limit each on
average (`max_token_cpu_seconds`, from --max-grammar-cpu-ms-per-token: 50 ms unless configured), the
request fails after that step, naming its field and the limit. An average, because
llguidance's lexer may spend up to its fuel (about 150 ms of CPU here) once, on a new state of a
legitimate grammar, where an ambiguous grammar's cost stays and grows. Matching does not recurse
per level of nesting (3,000 open brackets match on a 1 MiB stack): only compiling needs the deep
stack.

Speculation composes: a proposal is cut at its first token the grammar refuses, and each verifying
row is masked by the grammar's state after the proposed tokens before it (`masks_along`, rolled back
after), so verification samples exactly what plain constrained steps would. The masks of a step are
computed on a helper thread while the model runs the step (llguidance releases the GIL). Refused:
`ignore_eos` (the grammar's end is the model's EOS).
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tokenizers

from tandem.client.errors import InvalidArgument
from tandem.decoder.engine.params import StructuredOutput
from tandem.decoder.engine.sampling.constraint import Constraint
from tandem.decoder.engine.sampling.deep_stack import on_deep_stack
from tandem.decoder.engine.sampling.grammar_growth import MeteredMatcher, growth_bytes
from tandem.decoder.engine.sampling.grammar_limits import MAX_GRAMMAR_SIZE, MAX_LEXER_FUEL, MAX_LEXER_STATES
from tandem.decoder.engine.sampling.grammar_memory import GrammarMemoryBudget, estimated_bytes
from tandem.decoder.engine.sampling.grammar_messages import in_our_words, llguidance_reason, short

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SOURCE_CHARS = 64 * 1024  # a schema, regex or grammar: its text
MAX_CHOICES = 1024
# Verdicts kept, by content: no matcher, only a grammar's compiled text or its refusal, and the source
# it is kept by. Bounded by count and by bytes, not charged to a caller (grammar_memory.py): it is the
# engine's, and outlives any request. The compiled text is about its source's size (measured: 64,304
# characters of JSON schema 60,735, Lark and regexes within 0.2%), so an entry of the largest source
# holds 130 KB, and 4-byte characters (which Python keeps at 4 bytes each) took that to about 520 KB:
# 256 of them 133 MB. MAX_CACHE_BYTES keeps 256 of the largest ASCII sources, 64 of the 4-byte kind.
CACHE_SIZE = 256
MAX_CACHE_BYTES = 32 * 1024 * 1024
# The deepest JSON schema llguidance reads, in nested objects and arrays: its JSON parser stops at 128
# levels of recursion, 4 of them its own wrapping of the schema (measured with llguidance 1.9.1: 124
# passes and 125 fails, whether the levels are properties, items, anyOf or an enum's arrays; about 62
# levels of nested properties, two each). Past it llguidance said only "recursion limit exceeded at
# line 1 column 2491", naming no limit.
MAX_SCHEMA_DEPTH = 124


def check(spec: StructuredOutput) -> None:
    """The cheap rules, before anything is compiled: sizes and types."""
    if spec.kind not in KINDS:
        raise InvalidArgument("structured", f"kind must be one of {', '.join(KINDS)}, got {spec.kind!r}")
    if spec.kind == "choice":
        choices = spec.source
        if not isinstance(choices, tuple) or not choices or len(choices) > MAX_CHOICES:
            raise InvalidArgument(spec.field, f"must hold 1 to {MAX_CHOICES} strings")
        for index, choice in enumerate(choices):
            if not choice:  # structured.choice[3], as the gateway maps it to guided_choice[3]
                raise InvalidArgument(f"{spec.field}[{index}]", "must not be empty")
        if sum(map(len, choices)) > MAX_SOURCE_CHARS:
            raise InvalidArgument(spec.field, f"choices must be {MAX_SOURCE_CHARS} characters in all at most")
        return
    if not isinstance(spec.source, str) or (spec.kind != "json_object" and not spec.source):
        raise InvalidArgument(spec.field, "must not be empty")
    if len(spec.source) > MAX_SOURCE_CHARS:
        raise InvalidArgument(spec.field, f"{len(spec.source)} characters exceed {MAX_SOURCE_CHARS}")


@dataclass(frozen=True)
class _Verdict:
    """What building a grammar once said of its text: accepted (its compiled grammar), or refused."""

    grammar: str | None  # llguidance's grammar text, from which each request's matcher is built
    refusal: InvalidArgument | None  # why the grammar is refused, every time it is asked for


@dataclass(frozen=True)
class _Started:
    """A request's matcher as built for it, its first mask computed on the building thread."""

    matcher: MeteredMatcher  # llguidance's, charged as it grows: the request's alone, no token taken yet
    first_bitmask: bytes  # its first mask, which the request's first step takes instead of computing
    build_cpu_seconds: float  # building it and its first mask (its memory charge's measure)


class GrammarCompiler:
    """The engine's llguidance tokenizer and compiled-grammar cache."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        *,
        max_token_cpu_seconds: float,  # each request's constraint's limit (EngineConfig's, in seconds)
    ) -> None:
        import llguidance  # on first structured request: a text-only server never loads it

        self._llguidance = llguidance
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        self._eos_token_ids = frozenset(eos_token_ids)
        self.max_token_cpu_seconds = max_token_cpu_seconds
        self._cache: OrderedDict[StructuredOutput, _Verdict] = OrderedDict()  # by content, least recent first
        self._cache_bytes = 0  # what the cache's sources and verdicts hold (_held_bytes)
        self._lock = threading.Lock()  # request builders may compile concurrently
        self.memory = GrammarMemoryBudget()  # what live matchers hold (grammar_memory.py)

    def constraint(self, spec: StructuredOutput, caller: str = "") -> Constraint:
        """A fresh matcher for `spec`, the request's alone, charged to `caller` (Request.caller) until
        the constraint is collected. Raises InvalidArgument naming the field for what does not compile,
        ResourceExhausted where the live matchers hold too much (grammar_memory.py)."""
        check(spec)
        with self._lock:
            verdict = self._cache.get(spec)
            if verdict is not None:
                self._cache.move_to_end(spec)
        if verdict is None:
            verdict, started = on_deep_stack(lambda: self._judged(spec))
            self._keep(spec, verdict)
        else:  # accepted before: the same text builds the same way, its first mask and token passed
            started = None if verdict.refusal is not None else on_deep_stack(lambda: self._warm(verdict))
        if verdict.refusal is not None:  # a fresh one: a raised one keeps its traceback
            raise InvalidArgument(verdict.refusal.field, verdict.refusal.description)
        assert started is not None  # an accepted verdict comes with its request's matcher
        matcher = started.matcher
        # Its states built so far over its floor (grammar_growth.py) are charged with its build.
        nbytes = estimated_bytes(started.build_cpu_seconds) + growth_bytes(matcher.max_states)
        releases = [self.memory.reserve(caller, spec.field, nbytes)]  # refused: the matcher goes with it
        # Its lexer states as they grow, a tranche at a time; a refusal fails its request. What it holds
        # already is told, so a growth over a limit by itself is refused as such (grammar_memory.py).
        held = [nbytes]  # not the matcher's own count: a closure holding the matcher would be a cycle

        def charge(tranche: int) -> None:
            releases.append(self.memory.reserve(caller, spec.field, tranche, held_by_it=held[0]))
            held[0] += tranche

        matcher.charge = charge
        constraint = Constraint(
            matcher,
            self.vocab_size,
            spec.field,
            self._eos_token_ids,
            max_token_cpu_seconds=self.max_token_cpu_seconds,
            first_bitmask=started.first_bitmask,
        )
        constraint.build_bytes = nbytes
        # Given back with the matcher's memory, whichever way its request ended: nothing in the engine
        # need remember to.
        weakref.finalize(constraint, _release_all, releases)
        return constraint

    def _keep(self, spec: StructuredOutput, verdict: _Verdict) -> None:
        """Cache `verdict`, least recently used out first, within CACHE_SIZE and MAX_CACHE_BYTES."""
        with self._lock:
            replaced = self._cache.pop(spec, None)  # judged twice at once: kept once
            if replaced is not None:
                self._cache_bytes -= _held_bytes(spec, replaced)
            self._cache[spec] = verdict
            self._cache_bytes += _held_bytes(spec, verdict)
            while len(self._cache) > CACHE_SIZE or self._cache_bytes > MAX_CACHE_BYTES:
                self._cache_bytes -= _held_bytes(*self._cache.popitem(last=False))

    def _matcher(self, verdict: _Verdict, max_lexer_states: int | None = None) -> object:
        """A fresh llguidance matcher of `verdict`'s grammar, of `max_lexer_states` (MAX_LEXER_STATES)."""
        limits = self._llguidance.LLParserLimits(
            verbose_errors=False,
            initial_lexer_fuel=MAX_LEXER_FUEL,
            max_lexer_states=MAX_LEXER_STATES if max_lexer_states is None else max_lexer_states,
            max_grammar_size=MAX_GRAMMAR_SIZE,
        )
        return self._llguidance.LLMatcher(self._tokenizer, verdict.grammar, log_level=0, limits=limits)

    def _metered(self, verdict: _Verdict) -> MeteredMatcher:
        """A request's matcher, its lexer states charged as they grow (grammar_growth.py)."""
        # Its rebuilds on a deep stack, as its first build: building a matcher compiles its grammar.
        return MeteredMatcher(
            lambda max_states: self._matcher(verdict, max_states), MAX_LEXER_STATES, aside=on_deep_stack
        )

    def _warm(self, verdict: _Verdict) -> _Started:
        """A request's matcher for an accepted verdict, its first mask computed, as a first build's is:
        here, on the building thread. A fresh matcher's lexer is cold, and its first mask in the engine
        step held up the batch (`a{300}{100}` 20-28 ms; 64 requests of `[\\w .]{1,1000}` took Qwen3's
        first step from 4 to 95 ms). Computed here and handed to the request's constraint, it costs the
        step nothing: the first step's grammar CPU with SmolLM2, `a{300}{100}`, went from 20.2 ms (cold)
        to 6.2 (computed again, warm) to 0.1."""
        start = time.thread_time()
        matcher = self._metered(verdict)
        bitmask = matcher.compute_bitmask()
        return _Started(matcher, bitmask, time.thread_time() - start)

    def _judged(self, spec: StructuredOutput) -> tuple[_Verdict, _Started | None]:
        """`spec`'s verdict, and where accepted the request's matcher, its first mask computed."""
        try:
            grammar = self._grammar(spec)
        except InvalidArgument as e:
            return _Verdict(None, e), None
        verdict = _Verdict(grammar, None)
        start = time.thread_time()
        matcher = self._metered(verdict)
        if matcher.is_error():
            reason = llguidance_reason(matcher.get_error())
            error = InvalidArgument(spec.field, in_our_words(reason) or f"does not compile: {reason}")
            return _Verdict(None, error), None
        # The first mask, here rather than at the first step: a grammar no text can begin (a schema
        # that is only a reference to itself) fails only when it is asked for a token, and would
        # otherwise allow just EOS and end `stop` with an empty answer, which is no JSON at all.
        bitmask = matcher.compute_bitmask()
        build_cpu_seconds = time.thread_time() - start
        if matcher.is_error():
            reason = llguidance_reason(matcher.get_error())
            return _Verdict(
                None, InvalidArgument(spec.field, f"admits no answer: no text can begin it ({reason})")
            ), None
        # llguidance keeps what its first mask ran out of (the lexer's fuel, the parser's items) until
        # a token is taken: the attacker's `a{1000}{1000}` failed mid-stream after seconds. One token
        # the mask allows, taken on a matcher of its own, tells it here.
        failure = self._first_token_failure(verdict, bitmask)
        if failure is not None:
            return _Verdict(None, InvalidArgument(spec.field, failure)), None
        return verdict, _Started(matcher, bitmask, build_cpu_seconds)

    def _first_token_failure(self, verdict: _Verdict, bitmask: bytes) -> str | None:
        """Why the grammar fails at the first token its first mask allows (EOS aside), or None. Taken
        on a matcher built for the trial: no request's state, and no lexer a request shares. Not
        charged (grammar_memory.py), but bounded: the build's own fuel bounds it as it bounds the
        request's matcher, it takes one token, and it is gone before the request's matcher is charged;
        one a building thread at once."""
        bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[: self.vocab_size]
        allowed = np.flatnonzero(bits)
        first = next((int(t) for t in allowed if int(t) not in self._eos_token_ids), None)
        if first is None:
            return None
        trial = self._matcher(verdict)
        trial.compute_bitmask()  # type: ignore[attr-defined]
        trial.consume_token(first)  # type: ignore[attr-defined]
        if not trial.is_error():  # type: ignore[attr-defined]
            return None
        reason = llguidance_reason(trial.get_error())  # type: ignore[attr-defined]
        return in_our_words(reason) or f"fails at the first token it allows ({first}): {reason}"

    def _grammar(self, spec: StructuredOutput) -> str:
        grammar = self._compile(spec)
        is_error, messages = self._llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer
        )
        if is_error:
            reason = llguidance_reason(messages[0] if messages else "")
            raise InvalidArgument(spec.field, in_our_words(reason) or f"does not compile: {reason}")
        return grammar

    def _compile(self, spec: StructuredOutput) -> str:
        matcher = self._llguidance.LLMatcher
        if spec.kind == "json_schema":
            try:
                # Every member kept. Of a duplicate key json.loads keeps the last value, as llguidance
                # does, but llguidance's JSON parser counts its 128 levels in every value it reads, the
                # dropped ones too: a first value nested past them passed a depth measured on the last,
                # and llguidance refused it naming no limit. (One of 125 to 128 levels it would take.)
                schema = json.loads(spec.source, object_pairs_hook=_Members)  # type: ignore[arg-type]
            except (ValueError, RecursionError) as e:
                raise InvalidArgument(spec.field, f"is not valid JSON: {short(str(e))}") from None
            if not isinstance(schema, _Members | bool):
                raise InvalidArgument(spec.field, "must be a JSON schema (an object or a boolean)")
            if schema is False:
                raise InvalidArgument(
                    spec.field, "is false, a schema no JSON value satisfies: no answer fits it"
                )
            depth = _nesting_depth(schema)
            if depth > MAX_SCHEMA_DEPTH:
                raise InvalidArgument(
                    spec.field,
                    f"nests {depth} levels of objects and arrays, over the {MAX_SCHEMA_DEPTH} the grammar "
                    "compiler reads",
                )
            # `true` is the schema every JSON value satisfies, as `{}` is; llguidance takes only the
            # object form ("Expecting object schema").
            source = "{}" if schema is True else spec.source
            try:
                return matcher.grammar_from_json_schema(source, defaults={"whitespace_flexible": False})
            except (ValueError, TypeError) as e:
                raise InvalidArgument(spec.field, f"is not a usable JSON schema: {short(str(e))}") from None
        if spec.kind == "json_object":
            return matcher.grammar_from_json_schema(
                '{"type": "object"}', defaults={"whitespace_flexible": False}
            )
        if spec.kind == "regex":
            return matcher.grammar_from_regex(spec.source)  # type: ignore[arg-type]
        if spec.kind == "choice":
            return matcher.grammar_from_regex("|".join(re.escape(c) for c in spec.source))
        return matcher.grammar_from_lark(spec.source)  # type: ignore[arg-type]


def _held_bytes(spec: StructuredOutput, verdict: _Verdict) -> int:
    """What a cache entry holds: its source's strings, and its compiled text or refusal."""
    sources = spec.source if isinstance(spec.source, tuple) else (spec.source,)
    said = verdict.grammar if verdict.refusal is None else verdict.refusal.message
    return sum(map(sys.getsizeof, sources)) + sys.getsizeof(said)


def _release_all(releases: list[Callable[[], None]]) -> None:
    for release in releases:
        release()


class _Members(list[tuple[str, object]]):
    """A JSON object as parsed, each of its (key, value) members kept, a duplicate key's too."""


def _nesting_depth(value: object) -> int:
    """How deep `value`'s objects and arrays nest (a scalar 0, `{}` 1), walked without recursion. An
    object counts the values of all its members, each of a duplicate key's."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, _Members):
            children: list | None = [member for _, member in item]
        else:
            children = item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest
