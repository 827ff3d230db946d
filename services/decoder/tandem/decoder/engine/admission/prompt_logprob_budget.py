"""How many prompt-logprob entries one caller's open streams may hold at once.

NOTE: why a budget and not the pause. A request's prompt logprobs arrive as one Delta of one entry
per prompt position, each with up to MAX_TOP_LOGPROBS alternatives (~2 KB a position at 20); once
that Delta is handed to gRPC it sits in gRPC's buffers until the client reads it, where no pause can
reach it. So each stream that asks for them reserves its entries (positions x (1 + top)) from its
caller's budget when it is admitted and returns them when the stream ends; a request beyond the
budget is refused RESOURCE_EXHAUSTED, naming `output.prompt_logprobs`, before any position runs, with
the numbers in its ErrorInfo (PROMPT_LOGPROB_BUDGET) for a caller to tell a wait from a request that
never fits.
A caller is what `Request.caller` says (a connection, or a bearer token).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from tandem.client import error_reasons as reasons
from tandem.client.errors import ResourceExhausted
from tandem.decoder.engine.params import MAX_TOP_LOGPROBS

# Streams of full-context prompts at the most alternatives one caller may have open at once.
FULL_PROMPTS_PER_CALLER = 4


def num_entries(num_prompt_tokens: int, top: int) -> int:
    """Entries a prompt's logprobs take: each position's own token and its `top` alternatives."""
    return num_prompt_tokens * (1 + top)


class PromptLogprobBudget:
    """Entries reserved per caller. Thread-safe: building threads reserve, stream ends release."""

    def __init__(self, max_model_len: int, max_entries: int | None = None) -> None:
        self.max_entries = max_entries or FULL_PROMPTS_PER_CALLER * num_entries(
            max_model_len, MAX_TOP_LOGPROBS
        )
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def held(self, caller: str) -> int:
        with self._lock:
            return self._held[caller]

    def reserve(self, caller: str, entries: int) -> Callable[[], None]:
        """Holds `entries` for `caller`; returns what gives them back (call it once). Raises
        ResourceExhausted when the caller's open streams hold too many already."""
        with self._lock:
            if self._held[caller] + entries > self.max_entries:
                raise ResourceExhausted(
                    f"output.prompt_logprobs: this caller's open streams already hold {self._held[caller]} "
                    f"prompt-logprob entries; this request needs {entries} more (positions x (1 + top)) and "
                    f"the limit is {self.max_entries}; read or end a stream that scores its prompt",
                    retry_after_s=1.0,
                    info=reasons.decoder_info(
                        reasons.PROMPT_LOGPROB_BUDGET,
                        {
                            reasons.HELD_ENTRIES: self._held[caller],
                            reasons.NEEDED_ENTRIES: entries,
                            reasons.MAX_ENTRIES: self.max_entries,
                        },
                    ),
                )
            self._held[caller] += entries
        return lambda: self._release(caller, entries)

    def _release(self, caller: str, entries: int) -> None:
        with self._lock:
            self._held[caller] -= entries
            if not self._held[caller]:
                del self._held[caller]
