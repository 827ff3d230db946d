r"""A matcher's growth while decoding, charged as it happens: its lexer states, counted by llguidance's
own limit on them, raised a tranche at a time.

NOTE: why states, and why counted this way. A matcher grows while decoding by the lexer states it builds
(each mask explores the vocabulary's tokens from where the answer is): `[\w .]{1,1000}` built 0.8 MB and
grew by 27.5 MB in 531 single-character tokens (32,000 states) and 47 MB by 700, while its build was
charged about 4 MiB (grammar_memory.py); ordinary JSON schemas need under 500 states. llguidance (1.9.1)
reports nothing of a matcher's size or states, and the process's own measures cost too much or cannot
tell one matcher from another: glibc's mallinfo2 (process-wide) took 29 ms a call in a 451 MB heap of
37,000 free chunks, and a matcher's CPU time says nothing of its memory (`a{300}{100}` spent 12 s of CPU
masking 2,000 tokens and grew 0.2 MB; `[\w .]{1,1000}` 0.6 s and 47 MB). But llguidance enforces
max_lexer_states exactly ("too many states: N >= N"), so the limit is the meter: a matcher starts at
FIRST_MAX_LEXER_STATES, which the charge's floor (MIN_MATCHER_BYTES) covers, and where it reaches its
limit it is built again at twice the limit, charged BYTES_PER_LEXER_STATE for each state added, and given
the answer's tokens again (`consume_tokens`: 7-15 ms for 30-970 tokens measured with SmolLM2, at most
log2(MAX_LEXER_STATES / FIRST_MAX_LEXER_STATES) = 6 times a request, or straight to the limit where a
replay would be dear: the NOTE below). The states charged are the limit's,
never fewer than the matcher holds. Where the charge is refused (its caller's or the engine's live
grammars hold too much), the matcher stays stopped at its limit and the request fails after its step,
naming its field and the limit, as a grammar failing on the way does. A matcher built again holds only
the states of its answer's path and of its next mask, not those its earlier masks explored: `[\w .]{1,1000}`
held 12.3 MB after 700 tokens against 48.2 unmetered (charged 36.7), its 5 rebuilds over 900 tokens 4-20
ms each and its CPU in all unchanged.

NOTE: a rebuild and its replay are metering's work, not the grammar's. A rebuild in a step (a token's
taking filled the matcher) runs with its replay on a thread of its own (`aside`: structured.py's
deep-stack building thread, where a grammar is compiled; the thread that asked waits for it); a deferred
one (`defers_rebuilds`) builds there and replays on the engine thread in slices (`continue_rebuild`,
step/grammar_rebuilds.py). The grammar's CPU limits, per token and per step, time their own code, so they
never count either: a replay of an ambiguous grammar's answer is the whole answer's parsing again (`s: s s |
"a"` after 300 tokens: 333 ms in one step), and counted, it failed INVALID_ARGUMENT ("no step fits it")
a request that finishes unmetered. `rebuild_seconds` says what they cost.

NOTE: what a rebuild costs its neighbours. A replay costs about what the answer's taking of its
tokens cost so far (`consume_seconds`): `s: s s | "a"` after 500 tokens, about 3 s a replay on the tiny
model, and doubling the limit 6 times meant 6 of them (a plain neighbour's worst gap 3.1 s, 8.6 s beside
3 more, against 85 ms unmetered, while the step waited for each). So where a replay is predicted to
cost over EXPENSIVE_REPLAY_SECONDS (the answer's consume time), or a rebuild has measured over it, the
matcher grows straight to its limit of all in one charged tranche: a request replays expensively at
most about once (the one predicted cheap that measured dear, then the last). And a matcher the engine
runs `defers_rebuilds`: a mask or a proposal's check that fills it raises MatcherFull once its growth
is charged, and it is built again later, its replay given a slice at a time (`start_rebuild`,
`continue_rebuild`: step/grammar_rebuilds.py, where its request sits out the steps meanwhile and its
neighbours go on). Taking a sampled token still rebuilds at once: that token is the answer's, and a
mask has explored its states already. Each rebuild's seconds join the request's grammar seconds in a
step's budget (`take_rebuild_seconds`; step/grammar_budget.py), so the dearest heavy ones fail; a
request not heavy in its masks is never failed for a rebuild (it would have finished unmetered).

NOTE: a rebuilt matcher holds only the states of its answer's path, so near MAX_LEXER_STATES a
metered request may go on where an unmetered one failed "too many states" (`s "|" /[\w .]{1,1000}/` with
SmolLM2's vocabulary: unmetered failed at token 1,162; metered, rebuilt at 32,768 states, went on):
outcomes there depend on its rebuild history, not on the grammar and answer alone.

Not counted here: the parser's rows, about 0.5 KB a token for ordinary grammars (0.95 MB over 2,000
tokens of a JSON schema), which the floor covers, and the items an ambiguous grammar's rows hold (11
KB a token for `s: s s | "a"`), which the per-token CPU limit stops within a few hundred tokens.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tandem.client.errors import InvalidArgument, ResourceExhausted, TandemError

FIRST_MAX_LEXER_STATES = 1024  # what every matcher may build uncharged: its floor covers 1 MiB of states
# The memory of one lexer state, measured as glibc's in-use bytes over the states built, with
# SmolLM2's vocabulary: 618-941 bytes for `[\w .]{1,1000}`, `[a-z0-9]{1,1000}` and `.{1,2000}`
# (a row of the state table is 4 bytes per byte class of the grammar, 107 for `\w`, and its regex).
BYTES_PER_LEXER_STATE = 1024
# A replay's CPU past which the matcher grows to its limit of all at once (the NOTE): its neighbours
# wait for a replay, about 50 ms the per-token limit's own (--max-grammar-cpu-ms-per-token's default).
EXPENSIVE_REPLAY_SECONDS = 0.050
T = TypeVar("T")
_TOO_MANY_STATES = re.compile(r"too many states: (\d+) >= (\d+)")


def growth_bytes(max_lexer_states: int) -> int:
    """What a matcher's lexer states may hold beyond its floor, at a limit of `max_lexer_states`."""
    return max(0, max_lexer_states - FIRST_MAX_LEXER_STATES) * BYTES_PER_LEXER_STATE


class MatcherFull(Exception):  # noqa: N818 (a state, not a failure: the request goes on after its rebuild)
    """A matcher that `defers_rebuilds` filled its lexer states: its growth is charged, and nothing may
    be asked of it until it is built again (`start_rebuild`, `continue_rebuild`: the NOTE)."""


class MeteredMatcher:
    """An llguidance matcher whose lexer-state limit is raised, and charged, as it fills: the methods
    a Constraint calls, each as llguidance's. Not thread-safe: one thread at a time, as a
    Constraint's. `charge(nbytes)` charges a tranche (raising where refused); None until the request's
    matcher is charged at all (while it is built), when tranches are only counted (`max_states`)."""

    def __init__(
        self,
        build: Callable[[int], object],
        max_lexer_states: int,
        aside: Callable[[Callable[[], object]], object] = lambda work: work(),
    ) -> None:
        self._build = build  # a fresh llguidance matcher of the grammar at the given state limit
        self._aside = aside  # runs a build (and an in-step rebuild's replay) on its own thread (NOTE)
        self.rebuild_seconds = 0.0  # CPU time its rebuilds and replays took, on that thread
        self._unbilled_seconds = 0.0  # of rebuild_seconds, what no step's budget has taken yet
        self.consume_seconds = 0.0  # CPU its tokens' taking cost: what a replay of them costs, about
        self._is_replay_dear = False  # a rebuild measured over EXPENSIVE_REPLAY_SECONDS
        self._max_lexer_states = max_lexer_states  # the most it may ever have (structured.py's)
        self.max_states = min(FIRST_MAX_LEXER_STATES, max_lexer_states)  # its limit now
        self._matcher = build(self.max_states)
        self._tokens: list[int] = []  # the tokens llguidance recorded, to give a rebuilt matcher
        self.charge: Callable[[int], None] | None = None
        self.charged_bytes = 0  # what its tranches charged, since `charge` was given
        self.refusal: TandemError | None = None  # why its growth was refused: its request fails
        # Set by the engine: a mask or a check that fills it raises MatcherFull rather than rebuild it
        # there (the NOTE). A token's taking rebuilds at once either way.
        self.defers_rebuilds = False
        self.is_full = False  # it raised MatcherFull: it waits for its rebuild
        self._replay: _Replay | None = None  # its rebuild under way (start_rebuild)

    def compute_bitmask(self) -> bytes:
        return self._grown(lambda: self._matcher.compute_bitmask(), may_defer=True)  # type: ignore[attr-defined]

    def consume_token(self, token_id: int) -> bool:
        is_recorded = not self._matcher.is_stopped()  # type: ignore[attr-defined]
        start = time.thread_time()
        result = self._grown(lambda: self._matcher.consume_token(token_id))  # type: ignore[attr-defined]
        self.consume_seconds += time.thread_time() - start
        if is_recorded and not self._matcher.is_error():  # type: ignore[attr-defined]
            self._tokens.append(token_id)
        return result

    def validate_tokens(self, token_ids: list[int]) -> int:
        return self._grown(lambda: self._matcher.validate_tokens(token_ids), may_defer=True)  # type: ignore[attr-defined]

    def rollback(self, num_tokens: int) -> bool:
        del self._tokens[len(self._tokens) - num_tokens :]
        if self.is_full:  # its rebuild replays the tokens left
            return True
        return self._matcher.rollback(num_tokens)  # type: ignore[attr-defined]

    @property
    def is_rebuilding(self) -> bool:
        return self._replay is not None

    def start_rebuild(self) -> None:
        """A full matcher's (MatcherFull) rebuild begun: a fresh one at its raised limit, built on
        `aside` (building compiles its grammar); `continue_rebuild` gives it the answer's tokens."""
        assert self.is_full and self._replay is None, "a rebuild follows MatcherFull, once"
        self._replay = self._aside(functools.partial(_Replay.built, self._build, self.max_states))

    def continue_rebuild(self, max_seconds: float) -> bool:
        """Gives the rebuilt matcher the answer's tokens, one at a time, for about `max_seconds` at most
        (one token at least): llguidance takes a token holding the GIL, so a slice is all the engine's
        other work waits for. True once it has them all and has taken the full one's place."""
        replay = self._replay
        assert replay is not None, "continue_rebuild follows start_rebuild"
        deadline = time.perf_counter() + max_seconds
        start = time.thread_time()
        while replay.num_tokens < len(self._tokens):
            replay.matcher.consume_token(self._tokens[replay.num_tokens])  # type: ignore[attr-defined]
            replay.num_tokens += 1
            if time.perf_counter() >= deadline:
                break
        replay.seconds += time.thread_time() - start
        if replay.num_tokens < len(self._tokens):
            return False
        self._matcher, self.is_full, self._replay = replay.matcher, False, None
        self._count_rebuild(replay.seconds)
        return True

    def take_rebuild_seconds(self) -> float:
        """Its rebuilds' CPU since the last call: what its step's budget charges it (the NOTE)."""
        seconds, self._unbilled_seconds = self._unbilled_seconds, 0.0
        return seconds

    def is_stopped(self) -> bool:  # full, it has no state but the answer's tokens: it goes on after them
        return not self.is_full and self._matcher.is_stopped()  # type: ignore[attr-defined]

    def is_error(self) -> bool:
        return not self.is_full and self._matcher.is_error()  # type: ignore[attr-defined]

    def get_error(self) -> str:
        return self._matcher.get_error()  # type: ignore[attr-defined]

    def _grown(self, work: Callable[[], T], may_defer: bool = False) -> T:
        """work()'s result, done again on a matcher of twice the limit, charged, while it fails only
        for its lexer states and a higher limit is allowed. Where `may_defer` and the matcher
        `defers_rebuilds`, MatcherFull once the growth is charged: work() is the caller's to ask again
        after its rebuild."""
        assert not self.is_full, "a full matcher is asked nothing until rebuilt"
        while True:
            result = work()
            if not self._matcher.is_error() or self.refusal is not None:  # type: ignore[attr-defined]
                return result
            full = _TOO_MANY_STATES.search(self._matcher.get_error())  # type: ignore[attr-defined]
            if full is None or self.max_states >= self._max_lexer_states:
                return result  # the grammar's own failure, or past the limit of all: its error says
            limit = min(2 * self.max_states, self._max_lexer_states)
            if self._is_replay_dear or self.consume_seconds > EXPENSIVE_REPLAY_SECONDS:
                limit = self._max_lexer_states  # one dear replay, not one a doubling (the NOTE)
            if self.charge is not None:
                nbytes = growth_bytes(limit) - growth_bytes(self.max_states)
                try:
                    self.charge(nbytes)
                except TandemError as e:
                    # Without its traceback, whose frames hold the constraint: a cycle that kept the
                    # constraint, and its charge, until a garbage collection.
                    self.refusal = e.with_traceback(None)
                    return result
                self.charged_bytes += nbytes
            self.max_states = limit
            if may_defer and self.defers_rebuilds:
                self.is_full = True
                raise MatcherFull
            self._matcher = self._aside(functools.partial(self._rebuilt, limit, list(self._tokens)))

    def _rebuilt(self, max_states: int, tokens: list[int]) -> object:
        """A fresh matcher at `max_states`, given `tokens` (the answer so far), on the thread it runs on."""
        start = time.thread_time()
        matcher = self._build(max_states)
        if tokens:
            matcher.consume_tokens(tokens)  # type: ignore[attr-defined]
        self._count_rebuild(time.thread_time() - start)
        return matcher

    def _count_rebuild(self, seconds: float) -> None:
        self.rebuild_seconds += seconds
        self._unbilled_seconds += seconds
        self._is_replay_dear = self._is_replay_dear or seconds > EXPENSIVE_REPLAY_SECONDS


@dataclass
class _Replay:
    """A full matcher's rebuild under way: its fresh matcher, and how far its replay has come."""

    matcher: object  # llguidance's, at the raised limit
    num_tokens: int  # of the answer's tokens, those it has taken
    seconds: float  # CPU its building and replay took so far

    @classmethod
    def built(cls, build: Callable[[int], object], max_states: int) -> _Replay:
        """Built on the thread it runs on, its building's CPU counted."""
        start = time.thread_time()
        matcher = build(max_states)
        return cls(matcher, 0, time.thread_time() - start)


def growth_refusal(field: str, num_tokens: int, max_states: int, refusal: TandemError) -> TandemError:
    """Why a running request's matcher may not grow, naming its field, where it was, and the limit
    (the budget's refusal says which and how much)."""
    said = refusal.message.removeprefix(f"{field}: ")
    why = (
        f"the grammar's matcher grew while decoding, after {num_tokens} tokens of the answer past "
        f"{max_states:,} lexer states ({BYTES_PER_LEXER_STATE} bytes each), and its memory could not be "
        f"charged: {said}"
    )
    if isinstance(refusal, ResourceExhausted):  # others hold the memory: later it may fit
        return ResourceExhausted(f"{field}: {why}", retry_after_s=refusal.retry_after_s, info=refusal.info)
    return InvalidArgument(field, why, info=refusal.info)
