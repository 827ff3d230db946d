"""The gauges of the answers the gateway holds unread (`answer_bytes`), read at collection.

An operator sees how near the bytes are to --max-unread-answer-bytes and the largest caller's to
--max-unread-answer-bytes-per-caller, and how many answers wait for room (each a 429 or 503 once it has
waited --write-timeout-s), before callers are refused. No gauge per caller: callers are bearer tokens
or addresses, as many as connect, too many series and a token is no metric label.

The reader's export thread calls these, not the event loop that changes `AnswerBytes`: each reads an
int, a deque's length or a copy of the per-caller counts, made in C under the GIL, so a reading is
whole though it may be a moment old.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import metrics

from tandem.gateway.answer_bytes import AnswerBytes

# The gateway's own names, beside the services' in tandem.client.semconv (`tandem.engine.*`).
TANDEM_GATEWAY_UNREAD_ANSWER_BYTES = "tandem.gateway.unread_answers.bytes"
TANDEM_GATEWAY_UNREAD_ANSWER_LARGEST_CALLER_BYTES = "tandem.gateway.unread_answers.largest_caller_bytes"
TANDEM_GATEWAY_UNREAD_ANSWERS_WAITING = "tandem.gateway.unread_answers.waiting"

Readings = Iterable[metrics.Observation]


def observe_answer_bytes(meter: metrics.Meter, held: AnswerBytes) -> None:
    """Observable gauges over `held`, the gateway's unread answers."""

    def num_bytes(_: metrics.CallbackOptions) -> Readings:
        return [metrics.Observation(held.num_bytes)]

    def largest_caller_bytes(_: metrics.CallbackOptions) -> Readings:
        return [metrics.Observation(max(list(held.per_caller.values()), default=0))]

    def num_waiting(_: metrics.CallbackOptions) -> Readings:
        return [metrics.Observation(len(held.waiters))]

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
