"""Structured output: a grammar constrains which tokens a request may sample, so its answer parses.

llguidance does the grammar work (JSON schema, regular expressions, Lark grammars; a choice among
strings is a regular expression of them). Chosen over xgrammar by measurement (PERFORMANCE.md): both
compile a schema in about a millisecond and mask in microseconds; llguidance builds its tokenizer from
our tokenizer's JSON and bounds its work with parser limits, and needs no torch of its own. One
`GrammarCompiler` per engine holds the tokenizer in llguidance's form (built once: about 0.3 s for a
49k vocabulary) and a cache of verdicts by content: a grammar's compiled text where it was accepted,
its refusal where not, so a repeated hostile grammar is refused without a second build. Each request
gets its own `Constraint` on a matcher built for it alone (the grammar's state after the tokens
sampled so far), charged against the engine's and its caller's matcher memory while it lives
(grammar_memory.py). Not a copy of a cached matcher: llguidance's `deep_copy` shares the lexer, so every
request of one grammar added its lexer states to one pool, the first to exhaust it ("needs more lexer
states than allowed") failed every later request of that grammar at its first token until restart,
and each cached regex kept up to about 97 MB of states. A build costs up to MAX_LEXER_FUEL's bound
(0.1-0.3 s at worst, about a millisecond for a typical schema). Compiling, the first mask and a first
token taken on a matcher of its own (where llguidance reports what its first mask ran out of) run
before the request is queued, under llguidance's parser limits, so a hostile grammar costs its caller
an INVALID_ARGUMENT and nothing else; the request's first step takes that first mask rather than
computing it again (nothing is taken between). They run on a thread of their own with a deep stack
(COMPILE_STACK_BYTES says why). Each step the constraint's allowed tokens mask the request's logits
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
import logging
import re
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import tokenizers
import torch

from tandem.client.errors import InvalidArgument, TandemError
from tandem.decoder.engine.params import StructuredOutput
from tandem.decoder.engine.sampling.grammar_growth import MeteredMatcher, growth_bytes, growth_refusal
from tandem.decoder.engine.sampling.grammar_memory import GrammarMemoryBudget, estimated_bytes

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
# llguidance compiles and validates a grammar recursively, about 3 KB of stack per level of rules
# that name the next: within MAX_SOURCE_CHARS a Lark chain (`b: "a" c`) reaches 5,580 levels and a
# JSON schema's $ref chain 1,716, and either overflowed a thread's default 8 MiB stack, which killed
# the whole decoder with SIGSEGV. Compiling runs on a thread of this stack, about 4 times what the
# deepest 64 KiB source needs; only the pages it touches take memory.
COMPILE_STACK_BYTES = 64 * 1024 * 1024
# The deepest JSON schema llguidance reads, in nested objects and arrays: its JSON parser stops at 128
# levels of recursion, 4 of them its own wrapping of the schema (measured with llguidance 1.9.1: 124
# passes and 125 fails, whether the levels are properties, items, anyOf or an enum's arrays; about 62
# levels of nested properties, two each). Past it llguidance said only "recursion limit exceeded at
# line 1 column 2491", naming no limit.
MAX_SCHEMA_DEPTH = 124
# The work llguidance's lexer may do to build a grammar's regular expressions before its first mask
# (its initial_lexer_fuel; llguidance's default is 1,000,000). At the default the 13 bytes
# `a{1000}{1000}` cost 0.8-2.5 s of CPU per request to build and take their first mask, and the
# exhausted fuel showed only when the first token was taken, mid-stream. Measured with SmolLM2's
# vocabulary on a busy 2-core machine: that regex fails in 94 ms at this bound (31 ms at 100,000);
# JSON schemas (formats, 2,000 properties, 500 patterned anyOf), 1,024 choices, `\w{1,1000}` and
# `a{300}{100}` (30,000 characters) need under 100,000, but the deepest $ref chain within
# MAX_SOURCE_CHARS (1,716 levels) needs between 100,000 and 150,000.
MAX_LEXER_FUEL = 200_000
# The lexer states one matcher may build while decoding (llguidance's max_lexer_states; its default is
# 250,000). States are built as an answer goes on and kept until the request ends: a matcher starts at
# grammar_growth.FIRST_MAX_LEXER_STATES and is charged as it grows (grammar_growth.py), up to this, about
# 50 MB (`[\w .]{1,1000}` reached it after 1,156-1,301 random one-character tokens, 47 MB at 700).
# Measured with SmolLM2's vocabulary: 300 random tokens of `json_object` and of
# bench/structured_output.py's schema need under 500 states, and at 5,000 every structured test passes
# but one (`a{1000}{1000}` is then refused for its states before its fuel); this is 10 times that. The
# memory a build takes (`a{300}{190}`'s 20 MB) is the lexer fuel's to bound, and grammar_memory's to
# count.
MAX_LEXER_STATES = 50_000
# llguidance's bound on a compiled grammar's size (its max_grammar_size, left at its default).
MAX_GRAMMAR_SIZE = 500_000
NUM_MASKS_AVERAGED = 8  # masks whose CPU time per token is averaged against the limit (the NOTE)
log = logging.getLogger(__name__)
_STACK_SIZE = threading.Lock()  # threading.stack_size is process-wide: one setter at a time

T = TypeVar("T")


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


class Constraint:
    """One request's grammar state. Not thread-safe: the engine thread alone uses it after building."""

    def __init__(
        self,
        matcher: object,
        vocab_size: int,
        field: str = "structured",
        eos_token_ids: frozenset[int] = frozenset(),
        *,
        max_token_cpu_seconds: float,  # the grammar's work per token, on average (the NOTE)
        # The matcher's first mask (llguidance's packed bits), computed where it was built: the first
        # allowed() takes it, the matcher's state the same. None: the first allowed() computes it.
        first_bitmask: bytes | None = None,
    ) -> None:
        self._matcher = matcher
        self._first_bitmask = first_bitmask
        self._num_masked = 0  # tokens taken before its last mask: those sent before its step's
        self.vocab_size = vocab_size
        self.field = field  # the request's field that asked for it (structured.regex, ...)
        self.eos_token_ids = eos_token_ids  # the model's: sampled, one always ends the answer
        self.num_accepted = 0
        self._eos_inside: int | None = None  # an EOS ID the grammar took as text, not as its end
        self._refused: tuple[int, int] | None = None  # (tokens taken before it, token) the grammar refused
        self.max_token_cpu_seconds = max_token_cpu_seconds
        self._recent_seconds: deque[float] = deque(maxlen=NUM_MASKS_AVERAGED)  # CPU per mask and token
        self._too_slow: _TooSlow | None = None  # where the average first passed max_token_cpu_seconds
        self.build_bytes = 0  # its build's charge to its caller while it lives (grammar_memory.py)
        # Its matcher, where it grows charged as it goes (grammar_growth.py): a growth refused fails it.
        self.metered: MeteredMatcher | None = matcher if isinstance(matcher, MeteredMatcher) else None

    @property
    def memory_bytes(self) -> int:
        """What its matcher is charged: its build's estimate, and its lexer states' growth since."""
        return self.build_bytes + (self.metered.charged_bytes if self.metered is not None else 0)

    def allowed(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar accepts next."""
        # The first mask, given, opens its entry at what it costs here (nothing): the averages weigh
        # the grammar work the engine does.
        first, self._first_bitmask = self._first_bitmask, None
        self._num_masked = self.num_accepted
        compute = self._matcher.compute_bitmask if first is None else lambda: first  # type: ignore[attr-defined]
        bitmask = self._timed(compute, is_mask=True)
        words = np.frombuffer(bitmask, dtype="<u4")
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size]
        mask = np.zeros(self.vocab_size, dtype=bool)
        mask[: bits.shape[0]] = bits.astype(bool)
        return torch.from_numpy(mask)

    def accept(self, token_id: int) -> None:
        was_error = self.is_error
        self._consume(token_id)
        if not was_error and self._refused is None and self.is_error:
            self._refused = (self.num_accepted, token_id)
        self.num_accepted += 1
        if token_id in self.eos_token_ids and not self._matcher.is_stopped():  # type: ignore[attr-defined]
            self._eos_inside = token_id

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the grammar accepts in order from here (a proposal is cut there).
        Raises MatcherFull where its matcher filled and defers its rebuild (grammar_growth.py)."""
        if not token_ids:
            return 0
        validate = self._matcher.validate_tokens  # type: ignore[attr-defined]
        return int(self._timed(lambda: validate(token_ids), num_tokens=len(token_ids)))

    def masks_along(self, token_ids: list[int]) -> list[torch.Tensor]:
        """The allowed tokens here and after each of `token_ids` (a proposal the grammar accepts):
        1 + len(token_ids) masks, one per row verifying it. The state is left where it was. Raises
        MatcherFull where its matcher filled on the way and defers its rebuild (grammar_growth.py)."""
        masks = [self.allowed()]
        # llguidance records no token taken once the grammar has stopped (the EOS that a proposal
        # holds after a complete answer): rolling back those too undid tokens of the answer itself,
        # and the next token it took was refused (a request that failed only when speculating).
        num_recorded = 0
        try:
            for token_id in token_ids:
                num_recorded += not self._matcher.is_stopped()  # type: ignore[attr-defined]
                self._consume(token_id)
                masks.append(self.allowed())
        finally:  # a matcher full on the way (MatcherFull) is rebuilt at the answer, the proposal not in it
            if num_recorded:
                self._matcher.rollback(num_recorded)  # type: ignore[attr-defined]
        return masks

    @property
    def mask_seconds(self) -> float:
        """CPU time per mask (and taking its token) on average over the last NUM_MASKS_AVERAGED, a
        short start counted as cheap masks: the per-token limit's average, and the one the step's
        budget weighs (step/grammar_budget.py)."""
        return sum(self._recent_seconds) / NUM_MASKS_AVERAGED

    @property
    def is_error(self) -> bool:
        return bool(self._matcher.is_error())  # type: ignore[attr-defined]

    def error(self) -> TandemError | None:
        """Why the grammar cannot go on, or None. A grammar that compiles and begins can still exceed
        the parser's limits on the way (a regex of nested counts: `a{1000}{1000}`); its matcher then
        allows only EOS, which must not pass for an answer that parses. So must a grammar that names
        the model's EOS token as text (`<[id]>`, `<|endoftext|>`): sampled there, it ended the answer
        with FINISH_REASON_EOS where the grammar goes on. And a grammar whose work per token passed
        max_token_cpu_seconds on average (the module's NOTE) fails rather than hold up the batch. So
        does one whose matcher's growth could not be charged (grammar_growth.py), before llguidance's
        error for it, which names only its state limit."""
        metered = self.metered
        if metered is not None and metered.refusal is not None:
            # Counted: the tokens sent, those before the step it was refused in (the step's are not).
            num_sent = min(self._num_masked, self.num_accepted)
            return growth_refusal(self.field, num_sent, metered.max_states, metered.refusal)
        if self._eos_inside is not None:
            return InvalidArgument(
                self.field,
                f"the grammar takes the model's end-of-sequence token {self._eos_inside} as text, "
                f"after {self.num_accepted - 1} tokens of the answer, where the grammar is not "
                "complete, but that token always ends the answer: a grammar must not admit it as text "
                "(by naming it, or where the tokenizer does not mark it special)",
            )
        if self.is_error:  # llguidance's own limits first: its reason says more
            # Counted: the tokens before the one it refused (those sent), not that token; where its
            # mask failed, the tokens before that mask (the step's sampled token is accepted, not sent).
            emitted, what = min(self._num_masked, self.num_accepted), "stopped matching"
            if self._refused is not None:
                emitted, token_id = self._refused
                what = f"refused the sampled token {token_id}"
            detail = _llguidance_reason(self._matcher.get_error())  # type: ignore[attr-defined]
            ours = _in_our_words(detail)
            return InvalidArgument(
                self.field,
                f"the grammar failed after {emitted} tokens of the answer: it {what}"
                + (f": it {ours}" if ours else f" (the grammar engine said: {detail})" if detail else ""),
            )
        if self._too_slow is None:
            return None
        slow = self._too_slow
        return InvalidArgument(
            self.field,
            f"the grammar's work took {slow.seconds * 1000:.1f} ms of CPU per token (a mask, and taking "
            f"the token) on average over its last {NUM_MASKS_AVERAGED} masks, after {slow.num_accepted} "
            f"tokens of the answer, over the limit of {self.max_token_cpu_seconds * 1000:g} ms "
            "(an ambiguous grammar's parsing grows with its answer)",
        )

    def _consume(self, token_id: int) -> None:
        self._first_bitmask = None  # the state it was the mask of is gone
        consume = self._matcher.consume_token  # type: ignore[attr-defined]
        self._timed(lambda: consume(token_id))

    def _timed(self, run: Callable[[], T], is_mask: bool = False, num_tokens: int = 1) -> T:
        """run()'s result. Its CPU time (per token) opens a mask's entry or joins the last one; where
        the recent average passes the limit is kept for error(). This thread's CPU time: llguidance
        works on the calling thread (the GIL released)."""
        start = time.thread_time()
        result = run()
        seconds = (time.thread_time() - start) / num_tokens
        if is_mask or not self._recent_seconds:
            self._recent_seconds.append(seconds)
        else:
            self._recent_seconds[-1] += seconds
        average = self.mask_seconds  # a short start counts as cheap masks
        if average > self.max_token_cpu_seconds and self._too_slow is None:
            self._too_slow = _TooSlow(average, self.num_accepted)
        return result


@dataclass(frozen=True)
class _TooSlow:
    """Where the grammar's recent work first cost more than its constraint allows."""

    seconds: float  # CPU time per token, the average over the last NUM_MASKS_AVERAGED masks
    num_accepted: int  # tokens of the answer the grammar had taken by then


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
            reason = _llguidance_reason(matcher.get_error())
            error = InvalidArgument(spec.field, _in_our_words(reason) or f"does not compile: {reason}")
            return _Verdict(None, error), None
        # The first mask, here rather than at the first step: a grammar no text can begin (a schema
        # that is only a reference to itself) fails only when it is asked for a token, and would
        # otherwise allow just EOS and end `stop` with an empty answer, which is no JSON at all.
        bitmask = matcher.compute_bitmask()
        build_cpu_seconds = time.thread_time() - start
        if matcher.is_error():
            reason = _llguidance_reason(matcher.get_error())
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
        reason = _llguidance_reason(trial.get_error())  # type: ignore[attr-defined]
        return _in_our_words(reason) or f"fails at the first token it allows ({first}): {reason}"

    def _grammar(self, spec: StructuredOutput) -> str:
        grammar = self._compile(spec)
        is_error, messages = self._llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer
        )
        if is_error:
            reason = _llguidance_reason(messages[0] if messages else "")
            raise InvalidArgument(spec.field, _in_our_words(reason) or f"does not compile: {reason}")
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
                raise InvalidArgument(spec.field, f"is not valid JSON: {_short(str(e))}") from None
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
                raise InvalidArgument(spec.field, f"is not a usable JSON schema: {_short(str(e))}") from None
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


def on_deep_stack(work: Callable[[], T], stack_bytes: int = COMPILE_STACK_BYTES) -> T:
    """`work()` run on a fresh thread of `stack_bytes` stack, its result or exception returned or
    raised here. The thread ends with it: none is kept between compilations."""
    result: Future[T] = Future()

    def run() -> None:
        try:
            result.set_result(work())
        except BaseException as e:  # handed to the caller, which raises it
            result.set_exception(e)

    with _STACK_SIZE:
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=run, name="tandem-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    return result.result()


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


def _llguidance_reason(message: str) -> str:
    """llguidance's error, less its markers ('<non-verbose/>', under verbose_errors=False) and its
    empty words ('no error message'): what is left, if anything, says something. A panic's is its
    first line: its backtrace (frames, and llguidance's build paths) is logged, not told the client
    (`start: w "x"`, `w[lazy]: /[\\w .]{0,1000}/` panics on its first mask)."""
    if "<backtrace>" in message:
        message, _, backtrace = message.partition("<backtrace>")
        log.warning("llguidance failed: %s; its backtrace: %s", message.strip(), backtrace.strip())
    text = _short(message.replace("<non-verbose/>", "").replace("no error message", ""))
    return text.strip(" ;:,.")


def _in_our_words(reason: str) -> str | None:
    """llguidance's reason for a limit it hit, said as what it means for the grammar, or None."""
    if "too many expressions constructed" in reason:
        return (
            f"is too complex: building its regular expressions takes more than the {MAX_LEXER_FUEL:,} "
            "steps the grammar compiler allows (its lexer fuel; nested counts such as a{1000}{1000} "
            "spell out a million characters)"
        )
    if "schema too large" in reason:
        # llguidance's words alone named neither the limit nor what passed it. It is its JSON schema
        # compiler's own bound on the schemas it builds (allOf of anyOf multiply out: 4 allOf of 10
        # anyOf each, 3.5 KB, pass it, 3 do not), not max_grammar_size: at 100 times that the same
        # schema is refused the same way.
        return (
            "is too large: compiling it builds more than llguidance's JSON schema compiler allows (a "
            "fixed bound, apart from its max_grammar_size of "
            f"{MAX_GRAMMAR_SIZE:,}); each allOf of anyOf multiplies the alternatives to build"
        )
    if "too many states" in reason:
        return f"is too complex: its regular expressions need more lexer states than allowed ({reason})"
    if "Too many items" in reason and "ff_tokens" in reason:
        # Text the grammar forces, token by token, ran past the parser's items: a rule that requires
        # itself (a required property whose schema is its own) forces text that never ends.
        return (
            "admits no finite answer: the text it forces never ends (a rule that requires itself, "
            f"such as a required property whose schema is its own) ({reason})"
        )
    if "Current row has" in reason:
        return f"offers more alternatives at one point than the parser follows ({reason})"
    return None


def _short(message: str) -> str:
    return " ".join(message.split())[:300]
