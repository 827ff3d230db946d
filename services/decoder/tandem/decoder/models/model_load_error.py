"""The one error a checkpoint directory that cannot be served raises, whichever of its files is at fault."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A checkpoint directory that cannot be served; the message names the file or weight at fault."""
