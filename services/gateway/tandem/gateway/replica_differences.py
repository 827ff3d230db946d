"""How a replica's model differs from the gateway's, as the gateway's log lines say it: a replica left out
for its model (`Replicas._update`, at ERROR), and the replicas moving to another model
(`Replicas._choose_model`). What tells two models apart is `ReplicaModel.difference`'s."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.gateway.replica_model import ReplicaModel


def unlike(model: ReplicaModel, ours: ReplicaModel, serving_ours: Sequence[str]) -> str:
    """How a replica's `model` differs from the gateway's, `ours`, naming a replica that serves the latter
    (`serving_ours`: the others that do, in the order found)."""
    them = (
        f"{serving_ours[0]} and {len(serving_ours) - 1} more"
        if len(serving_ours) > 1
        else "".join(serving_ours)
    )
    served_by = f" (served by {them})" if them else ""
    difference = model.difference(ours)
    if difference == "model":
        return f"serves model {model.name!r}, not {ours.name!r}{served_by}"
    if difference == "embedder":
        return (
            f"embeds for model {model.name!r} with a {model.embedder!r} embedder, not "
            f"{ours.embedder!r}{served_by}"
        )
    what = "token table samples" if difference == "token_table_sample" else "weight samples"
    return (
        f"serves model {model.name!r} from another checkpoint than {ours.name!r}{served_by}: "
        f"their {what} differ"
    )


def how_moved(chosen: ReplicaModel, before: ReplicaModel) -> str:
    """What the replicas' new model, `chosen`, is beside the one `before` where its name does not say it:
    "" (another name), " (another checkpoint)" or " (a ... embedder)"."""
    difference = chosen.difference(before)
    how = "" if difference == "model" else " (another checkpoint)"
    if difference == "embedder":
        how = f" (a {chosen.embedder!r} embedder)"
    return how
