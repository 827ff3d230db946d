"""Samples of a checkpoint's later weights, compared by name, shape and values and carried in a reply:
what the gateway compares across its decoder replicas beside the token table sample (without torch)."""

from __future__ import annotations

from tandem.common.weight_sample import (
    WeightSample,
    weight_sample_from_pb,
    weight_sample_to_pb,
    weights_agree,
)

VALUES = tuple((i - 64) / 1000 + 1e-9 for i in range(128))  # not float32 numbers: rounded on the wire
DOWN = WeightSample("model.layers.1.mlp.down_proj.weight", 64, 256, VALUES)
NORM = WeightSample("model.norm.weight", 1, 64, VALUES[:8])


def _scaled(sample: WeightSample, factor: float) -> WeightSample:
    return WeightSample(sample.name, sample.rows, sample.columns, tuple(v * factor for v in sample.values))


def test_a_sample_carried_in_a_reply_agrees_with_itself() -> None:
    read = weight_sample_from_pb(weight_sample_to_pb(DOWN))
    assert (read.name, read.rows, read.columns) == (DOWN.name, 64, 256)
    assert read.values != VALUES and read.agrees_with(DOWN)  # float32 on the wire, within rounding


def test_values_moved_beyond_the_storage_rounding_disagree_and_within_it_agree() -> None:
    assert not weights_agree([DOWN, NORM], [_scaled(DOWN, 1 + 2.0**-5), NORM])
    assert weights_agree([DOWN, NORM], [_scaled(DOWN, 1 + 2.0**-9), _scaled(NORM, 1 - 2.0**-9)])
    # What the tolerance leaves: a tune moving every sampled value by less than 2^-7 passes.
    assert weights_agree([DOWN], [_scaled(DOWN, 1 + 2.0**-8)])


def test_another_shape_disagrees_whatever_its_values() -> None:
    assert not DOWN.agrees_with(WeightSample(DOWN.name, 32, 256, VALUES))


def test_only_the_tensors_both_sampled_are_compared() -> None:
    assert weights_agree([DOWN, NORM], [NORM]) and weights_agree([], [DOWN])
    head = WeightSample("lm_head.weight", 1024, 64, VALUES)  # one stores a tied head, the other not
    assert weights_agree([DOWN, head], [DOWN])


def test_two_full_samples_with_no_tensor_in_common_disagree() -> None:
    # Nothing compared is no agreement: one model's tensors under two layouts' names passed as the same.
    renamed = [WeightSample("language_model." + s.name, s.rows, s.columns, s.values) for s in (DOWN, NORM)]
    assert not weights_agree([DOWN, NORM], renamed)
    assert weights_agree([DOWN], renamed)  # one sample alone is not full: what both report is compared
