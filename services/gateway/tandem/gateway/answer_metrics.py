"""The gauges of the answers the gateway holds unread (`answer_bytes`), read at collection.

An operator sees how near the bytes are to --max-unread-answer-bytes and the largest caller's to
--max-unread-answer-bytes-per-caller, and how many answers wait for room (each a 429 or 503 once it has
waited --write-timeout-s), before callers are refused. No gauge per caller: callers are bearer tokens
or addresses, as many as connect, too many series and a token is no metric label.

The reader's export thread calls these, not the event loop that changes `AnswerBytes`, and each gauge's
callback at its own moment of a collection: the three read one copy of its counts (`_Readings`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry import metrics

from tandem.gateway.answer_bytes import AnswerBytes

# The gateway's own names, beside the services' in tandem.client.semconv (`tandem.engine.*`).
TANDEM_GATEWAY_UNREAD_ANSWER_BYTES = "tandem.gateway.unread_answers.bytes"
TANDEM_GATEWAY_UNREAD_ANSWER_LARGEST_CALLER_BYTES = "tandem.gateway.unread_answers.largest_caller_bytes"
TANDEM_GATEWAY_UNREAD_ANSWERS_WAITING = "tandem.gateway.unread_answers.waiting"

Readings = Iterable[metrics.Observation]


@dataclass(frozen=True)
class _Reading:
    num_bytes: int  # all callers' bytes held: the sum of the per-caller counts copied
    largest_caller_bytes: int  # the largest of them
    num_waiting: int  # answers waiting for room


class _Readings:
    """The gauges' readings of one collection, from one copy of `held`'s counts.

    NOTE: why one copy. Each gauge's callback runs at its own moment of a collection while the event
    loop changes `held`: read apart, the largest caller's bytes could pass all callers' (4 in 67,527
    collections under a 1 µs switch interval). So the first callback of a collection copies the
    per-caller counts (one C call under the GIL: a state the loop left whole, as it changes a count in
    one step) and every gauge reads that copy, all callers' bytes its sum (`num_bytes` at that moment,
    which the loop changes apart from the count). A gauge read a second time starts the next collection.
    The SDK collects under a lock, calling each gauge once a collection, so one copy serves each."""

    def __init__(self, held: AnswerBytes) -> None:
        self._held = held
        self._reading = _Reading(0, 0, 0)
        self._read_by: set[str] | None = None  # the gauges that read `_reading`; None: none taken yet

    def read(self, gauge: str) -> _Reading:
        if self._read_by is None or gauge in self._read_by:
            counts = list(self._held.per_caller.values())
            self._reading = _Reading(sum(counts), max(counts, default=0), len(self._held.waiters))
            self._read_by = set()
        self._read_by.add(gauge)
        return self._reading


def observe_answer_bytes(meter: metrics.Meter, held: AnswerBytes) -> None:
    """Observable gauges over `held`, the gateway's unread answers."""
    readings = _Readings(held)

    def num_bytes(_: metrics.CallbackOptions) -> Readings:
        return [metrics.Observation(readings.read(TANDEM_GATEWAY_UNREAD_ANSWER_BYTES).num_bytes)]

    def largest_caller_bytes(_: metrics.CallbackOptions) -> Readings:
        reading = readings.read(TANDEM_GATEWAY_UNREAD_ANSWER_LARGEST_CALLER_BYTES)
        return [metrics.Observation(reading.largest_caller_bytes)]

    def num_waiting(_: metrics.CallbackOptions) -> Readings:
        return [metrics.Observation(readings.read(TANDEM_GATEWAY_UNREAD_ANSWERS_WAITING).num_waiting)]

    meter.create_observable_gauge(
        TANDEM_GATEWAY_UNREAD_ANSWER_BYTES,
        [num_bytes],
        unit="By",
        description="JSON of non-streamed answers being written, all callers' (--max-unread-answer-bytes)",
    )
    meter.create_observable_gauge(
        TANDEM_GATEWAY_UNREAD_ANSWER_LARGEST_CALLER_BYTES,
        [largest_caller_bytes],
        unit="By",
        description="The same, of the caller holding the most (--max-unread-answer-bytes-per-caller)",
    )
    meter.create_observable_gauge(
        TANDEM_GATEWAY_UNREAD_ANSWERS_WAITING,
        [num_waiting],
        unit="{answer}",
        description="Decoded non-streamed answers waiting for room under either bound",
    )
