"""The encoder-part tests' fixtures (a stand-in encoder and the parts fetching from it), found by name."""

from .encoder_stand_in import encoder, parts, stand_in  # noqa: F401  (fixtures, found by name)
