"""The gauges of the decoder replicas, and of the encoder replicas (`encoders.py`), the gateway leaves out
for their model (`replicas.py`), read at collection.

A replica left out serves, answers its health checks, and gets no calls: /health stays "ok" while
another serves, and the ERROR line is said once, as it is left out. An operator alerts on this gauge
above 0 instead. No label per replica: replicas come and go (a `dns:` name's), too many series.

The reader's export thread calls it, not the event loop that changes `Replicas`: it reads one count the
loop replaces whole (`Replicas.num_left_out`).
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import metrics

from tandem.gateway.replicas import Replicas

# The gateway's own names, beside answer_metrics.py's (`tandem.gateway.*`).
TANDEM_GATEWAY_REPLICAS_LEFT_OUT = "tandem.gateway.replicas.left_out"  # the decoder's
TANDEM_GATEWAY_ENCODER_REPLICAS_LEFT_OUT = "tandem.gateway.encoder_replicas.left_out"


def observe_replicas(
    meter: metrics.Meter, replicas: Replicas, name: str = TANDEM_GATEWAY_REPLICAS_LEFT_OUT
) -> None:
    """An observable gauge, `name`, of `replicas` left out for serving another model than the gateway's."""

    def left_out(_: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(replicas.num_left_out)]

    meter.create_observable_gauge(
        name,
        [left_out],
        unit="{replica}",
        description=f"{replicas.kind.capitalize()} replicas that serve another model than the gateway's: "
        "they get no calls",
    )
