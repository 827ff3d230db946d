"""The engine's state of one live request (`Tracked`), apart from the scheduler's `Request`.

Its own module because the step's collaborators (speculation.py, sampled_rows.py, adapter_slots.py)
read and update it as core.py does, and none of them may import core.py, which imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.decoder.engine.outputs.backpressure import ReaderProgress
from tandem.decoder.engine.outputs.outputs import Event, OutputState
from tandem.decoder.engine.request import Request
from tandem.decoder.engine.sampling.prompt_lookup import PromptLookup

EventCallback = Callable[[Event], None]  # receives one request's events, on the engine thread


@dataclass
class Tracked:
    """Engine-side state of one live request, keyed by the engine's key (`request.request_id`)."""

    request: Request
    output: OutputState
    on_event: EventCallback
    # Seeded requests: one generator per token sampled in a step (1 + proposed tokens), reseeded for
    # the output position it samples before every step. Empty for unseeded requests.
    generators: list[torch.Generator]
    deadline: float | None  # time.monotonic() after which a still-queued request fails
    progress: ReaderProgress | None  # how far its reader is behind; None: never paused
    lookup: PromptLookup | None  # its token history, when it speculates
    # Tokens to propose next: the request's maximum after a fully accepted proposal, one more than
    # the accepted ones after a rejection, so a request whose guesses miss costs one extra position.
    num_to_propose: int = 0
    # Its grammar's CPU time a row (a mask, and taking its token) in its last two steps that masked it,
    # the last first: the trend its next proposal is cut by (grammar_budget.row_seconds_ahead).
    grammar_row_seconds: tuple[float, float] = (0.0, 0.0)
