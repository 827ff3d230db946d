"""Domain errors shared by both services.

Pure Python on purpose: the scheduler, the params and the codec raise these without importing
grpc; `tandem.client.status` is the one place that turns them into gRPC statuses with google.rpc details.
Each error carries what a client needs to fix or retry its call: the offending field and its
limit, or how long to wait; and where a program should tell one refusal from another, its `ErrorInfo`
(a reason and the numbers the message says for people). `ConfigError`, the one error of another kind, is
what a service refuses at start; it names the config field so the command line can name the flag and its
variable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class ErrorInfo:
    """Which refusal this is, for programs: google.rpc.ErrorInfo beside the status, so a caller
    branches on `reason` and reads the numbers from `metadata` rather than parsing the message, whose
    wording may change. The reasons and their keys are `tandem.client.error_reasons`'."""

    reason: str  # UPPER_SNAKE_CASE, stable across releases: "PROMPT_LOGPROB_BUDGET"
    domain: str  # the service that refused: "tandem.decoder"
    # lowerCamelCase keys with the unit in the key ("maxEntries": "244608"), as google.rpc.ErrorInfo asks.
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)


class TandemError(Exception):
    """Base of every error a client is meant to see (anything else is a bug -> INTERNAL)."""

    def __init__(self, message: str, *, info: ErrorInfo | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.info = info


class InvalidArgument(TandemError):
    """A request field is malformed or outside its limit. `field` is its path, e.g.
    `prompt[2].embeddings.shape`."""

    def __init__(self, field: str, description: str, *, info: ErrorInfo | None = None) -> None:
        super().__init__(f"{field}: {description}", info=info)
        self.field = field
        self.description = description


class FailedPrecondition(TandemError):
    """The request is well-formed but this server is configured not to serve it."""

    def __init__(self, field: str, description: str, *, info: ErrorInfo | None = None) -> None:
        super().__init__(f"{field}: {description}", info=info)
        self.field = field
        self.description = description


class ResourceExhausted(TandemError):
    """The server is full right now; the same request may succeed after `retry_after_s`. None: not
    by waiting (only another call frees the resource, e.g. UnloadAdapter): no RetryInfo is sent."""

    def __init__(
        self, message: str, retry_after_s: float | None = 1.0, *, info: ErrorInfo | None = None
    ) -> None:
        super().__init__(message, info=info)
        self.retry_after_s = retry_after_s


class Unavailable(TandemError):
    """Loading, draining or after an engine failure: retry, possibly elsewhere."""


class DeadlineExceeded(TandemError):
    """The caller's deadline passed before the work could be done."""


class NotFound(TandemError):
    """A named resource (e.g. a model name) is not served here."""


class AlreadyExists(TandemError):
    """A named resource (e.g. a LoRA adapter) exists already; remove it first."""


class ModelFault(TandemError):
    """The model failed at this one request (its logits held NaN or infinity): INTERNAL, since no
    change to the request is known to help; the server and the other requests go on."""


class ConfigError(ValueError):
    """A configuration value a service refuses at start (never sent to a client).

    `field` is the config field at fault (e.g. `max_num_seqs`) and `reason` reads after its name
    (`must be >= 1, got 0`), so the command line can say the same with the flag and its variable:
    `--max-num-seqs (TANDEM_MAX_NUM_SEQS) must be >= 1, got 0`.
    """

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason  # "must be >= 1, got 0", or ": <a message of its own>"
        super().__init__(self.said_of(field))

    def said_of(self, name: str) -> str:
        """The error about `name`: the field, or a flag and its variable."""
        return name + ("" if self.reason.startswith(":") else " ") + self.reason
