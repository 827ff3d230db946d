"""The gateway's gauges as a test reads them: each one's reading of one collection, by name."""

from __future__ import annotations

from opentelemetry.sdk.metrics.export import InMemoryMetricReader


def readings(reader: InMemoryMetricReader) -> dict[str, float]:
    """Each gauge's one reading, by name."""
    data = reader.get_metrics_data()
    return {
        metric.name: point.value
        for resource in (data.resource_metrics if data else [])
        for scope in resource.scope_metrics
        for metric in scope.metrics
        for point in metric.data.data_points
    }
