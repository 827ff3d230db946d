"""How the gateway's log says a replica's model differs from its own (`replica_differences.py`): by its
name, its embedder, or the samples of another checkpoint under one name, naming a replica that serves
the gateway's model; and what the replicas' new model is where its name does not say it."""

from __future__ import annotations

import pytest

from tandem.common.token_table_sample import TableSample
from tandem.common.weight_sample import WeightSample
from tandem.gateway.replica_differences import how_moved, unlike
from tandem.gateway.replica_model import ReplicaModel

BASE = TableSample(1024, 64, tuple((i - 64) / 100 for i in range(128)))
TUNED = TableSample(1024, 64, tuple(-v for v in BASE.values))  # one shape, other weights
DOWN = WeightSample("model.layers.1.mlp.down_proj.weight", 64, 256, BASE.values)
DOWN_TUNED = WeightSample(DOWN.name, 64, 256, tuple(v * 1.05 for v in DOWN.values))

OURS = ReplicaModel("m", BASE, (DOWN,))


ANOTHER_CHECKPOINT = "serves model 'm' from another checkpoint than 'm' (served by a:1): their"


@pytest.mark.parametrize(
    ("model", "ours", "said"),
    [
        (ReplicaModel("n", BASE, (DOWN,)), OURS, "serves model 'n', not 'm' (served by a:1)"),
        (ReplicaModel("m", TUNED, (DOWN,)), OURS, f"{ANOTHER_CHECKPOINT} token table samples differ"),
        (ReplicaModel("m", BASE, (DOWN_TUNED,)), OURS, f"{ANOTHER_CHECKPOINT} weight samples differ"),
        (
            ReplicaModel("m", BASE, embedder="projector"),
            ReplicaModel("m", BASE, embedder="lookup"),
            "embeds for model 'm' with a 'projector' embedder, not 'lookup' (served by a:1)",
        ),
    ],
    ids=["name", "token table", "weights", "embedder"],
)
def test_a_replica_left_out_is_said_by_what_tells_its_model_from_the_gateways(
    model: ReplicaModel, ours: ReplicaModel, said: str
) -> None:
    assert unlike(model, ours, ["a:1"]) == said


def test_the_replicas_serving_the_gateways_model_are_named_first_and_counted() -> None:
    """One named, the others counted: a log line of 100 replicas' addresses says no more."""
    other = ReplicaModel("n", BASE)
    assert unlike(other, OURS, []) == "serves model 'n', not 'm'"
    said = unlike(other, OURS, ["a:1", "b:1", "c:1"])
    assert said == "serves model 'n', not 'm' (served by a:1 and 2 more)"


@pytest.mark.parametrize(
    ("chosen", "how"),
    [
        (ReplicaModel("n", BASE, (DOWN,)), ""),  # its name says it
        (ReplicaModel("m", TUNED, (DOWN,)), " (another checkpoint)"),
        (ReplicaModel("m", BASE, (DOWN_TUNED,)), " (another checkpoint)"),
        (ReplicaModel("m", BASE, (DOWN,), embedder="projector"), " (a 'projector' embedder)"),
    ],
)
def test_the_replicas_moving_to_a_model_of_the_same_name_say_how_it_differs(
    chosen: ReplicaModel, how: str
) -> None:
    assert how_moved(chosen, OURS) == how
