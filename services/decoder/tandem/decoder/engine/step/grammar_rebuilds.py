"""Grammar matchers rebuilt off the step's path: a request whose matcher filled its lexer states sits
out the steps while its matcher is built again and given its answer (sampling/grammar_growth.py), and
its neighbours go on decoding.

NOTE: why, and why in slices. A rebuild replays the answer into a fresh matcher, and an ambiguous
grammar's replay is its whole answer's parsing again: `s: s s | "a"` after 500 tokens, 1.9-2.7 s on the
tiny model, and while the step waited for it every request of the batch did too (a plain neighbour got no
token: its worst gap 1.9-2.7 s, against 52-156 ms unmetered). Now the mask (or the proposal's check) that
fills a matcher raises MatcherFull once its growth is charged: that request's rows of the step are
dropped (its KV blocks stay; it runs its last position again when it rejoins), and the scheduler is told
it is not runnable (`pending`) until its rebuild is done. The replay cannot run on a thread beside the
steps: llguidance takes tokens holding the GIL, so the engine thread's Python waited behind each call (a
replay on its own thread left the neighbour 7 tokens in 2 s and a 724 ms gap). So each step gives the
rebuilds REPLAY_SECONDS_PER_STEP of the engine thread, the oldest first, a token at a time (`advance`): a
neighbour's gap grows by about that, and by the fresh matcher's build once a rebuild (not sliced: up to
about 60 ms for a 57,000-character JSON schema, 12-25 ms at half that), and the rebuilding request
rejoins the step after its replay ends, with its new matcher (that neighbour: 99-115 tokens during a
sliced replay of 3.4-4.2 s, its worst gap across it 66-84 ms). Its masks are the ones an unmetered
matcher gives, and its samples the same: the same position's logits (a seeded request's noise is its
output position's), the same proposal from the same history. A request that leaves while rebuilding
(cancelled, finished, failed, the engine stopped) is dropped (`drop`): nothing of its rebuild goes on,
and its constraint, which holds its grammar charge, goes with the request.
"""

from __future__ import annotations

import time
from collections.abc import Container

from tandem.decoder.engine.sampling.constraint import Constraint

# A step's time given to rebuilds' replays: a neighbour's gap between tokens grows by about this while
# one runs (one token's taking may pass it: the per-token CPU limit bounds that on average). The
# replay of `s: s s | "a"` after 500 tokens (about 2 s of CPU) then took 3.4-4.2 s beside a neighbour.
REPLAY_SECONDS_PER_STEP = 0.020


class GrammarRebuilds:
    """The requests whose matchers are being rebuilt, by engine key, oldest first. The engine thread
    alone calls it, and alone touches their constraints."""

    def __init__(self, max_seconds_per_step: float = REPLAY_SECONDS_PER_STEP) -> None:
        self.max_seconds_per_step = max_seconds_per_step
        self._rebuilding: dict[str, Constraint] = {}

    def start(self, key: str, constraint: Constraint) -> None:
        """Rebuild `constraint`'s full matcher (MatcherFull); request `key` is not runnable meanwhile."""
        self._rebuilding[key] = constraint

    def pending(self) -> set[str]:
        """The keys of the requests not runnable: their rebuilds are not done."""
        return set(self._rebuilding)

    def advance(self) -> None:
        """This step's slice of the rebuilds, the oldest first: each one done rejoins the next step."""
        deadline = time.perf_counter() + self.max_seconds_per_step
        for key, constraint in list(self._rebuilding.items()):
            metered = constraint.metered
            assert metered is not None  # only a metered matcher fills
            if not metered.is_rebuilding:
                metered.start_rebuild()
            if metered.continue_rebuild(max(0.0, deadline - time.perf_counter())):
                del self._rebuilding[key]
            if time.perf_counter() >= deadline:
                return

    def drop(self, live: Container[str]) -> None:
        """Forget the rebuilds of requests no longer `live`."""
        for key in [key for key in self._rebuilding if key not in live]:
            del self._rebuilding[key]
