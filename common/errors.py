"""Domain errors shared by both services.

Pure Python on purpose: the scheduler, the params and the codec raise these without importing
grpc; `common.status` is the one place that turns them into gRPC statuses with google.rpc details.
Each error carries what a client needs to fix or retry its call: the offending field and its
limit, or how long to wait.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error a client is meant to see (anything else is a bug -> INTERNAL)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(TandemError):
    """A request field is malformed or outside its limit. `field` is its path, e.g.
    `prompt[2].embeddings.shape`."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


class FailedPrecondition(TandemError):
    """The request is well-formed but this server is configured not to serve it."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


class ResourceExhausted(TandemError):
    """The server is full right now; the same request may succeed after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(TandemError):
    """Loading, draining or after an engine failure: retry, possibly elsewhere."""


class DeadlineExceeded(TandemError):
    """The caller's deadline passed before the work could be done."""


class NotFound(TandemError):
    """A named resource (e.g. a model name) is not served here."""
