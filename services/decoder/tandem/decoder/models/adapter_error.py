"""The one error an adapter's refusal raises, wherever in its reading it is found."""

from __future__ import annotations

from tandem.client.errors import InvalidArgument


class AdapterError(InvalidArgument, ValueError):
    """An adapter that cannot be served here; `field` names the file and its entry. Every refusal of an
    adapter is one (the start-up check turns exactly these into a ConfigError, LoadAdapter into
    INVALID_ARGUMENT): a malformed value that reached a library call instead came out as INTERNAL, or a
    traceback at start."""
