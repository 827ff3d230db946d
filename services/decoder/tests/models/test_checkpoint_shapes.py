"""The shapes a config implies are the ones the built model reads. What a checkpoint that disagrees
gets is test_loader.py's (check_checkpoint, before the server listens)."""

from __future__ import annotations

import torch

from tandem.common.weight_shapes import expected_weights
from tandem.decoder.models import loader
from tandem.decoder.models.checkpoint_shapes import text_model_shape
from tandem.decoder.models.registry import MODEL_CLASSES

from ..conftest import Checkpoint


def test_the_shapes_checked_are_those_the_built_model_reads(checkpoint: Checkpoint) -> None:
    """The check's shapes come from the config alone; the loader's from the built model's parameters
    (checkpoint_parts). They must agree for every family variant, or one would refuse what the other
    loads."""
    config = loader.check_checkpoint(checkpoint.path)
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    read = {
        part.name: part.shape for name, _ in model.named_parameters() for part in model.checkpoint_parts(name)
    }
    assert {name: w.shape for name, w in expected_weights(text_model_shape(config)).items()} == read
