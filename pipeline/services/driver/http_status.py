"""The driver's status server: ``GET /health`` and ``GET /metrics``, served by aiohttp.

- ``/health``: 200 with a JSON body while the driver's poll loop is alive, else 503 (a
  liveness probe); the body says whether every assigned partition is built (``ready``) and
  which partitions are owned.
- ``/metrics``: ``prometheus_client``'s exposition: the driver's plain counters and gauges
  (``DriverMetrics.snapshot``) named ``dsh_driver_<name>`` (counters end in ``_total``),
  then the text of ``labelled`` (the runners' registry, ``RunnerMetrics.render``) when given.

Nothing secret is ever served (counters only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.adapters.metrics.http import Health, StatusHttpServer

GAUGES: Final = frozenset({"partitions_owned", "turns_in_flight", "throttled", "ready",
                           "sessions_in_memory", "sessions_indexed", "provider_waiting",
                           "provider_wait_ms_longest"})
Snapshot = Callable[[], Mapping[str, int]]
Rendered = Callable[[], str]


class SnapshotCollector(Collector):
    """The values of ``snapshot()`` at each scrape: gauges by name (:data:`GAUGES`), the
    rest counters."""

    def __init__(self, snapshot: Snapshot, prefix: str = "dsh_driver_") -> None:
        self._snapshot = snapshot
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self._snapshot().items()):
            metric = f"{self._prefix}{name}"
            if name in GAUGES:
                yield GaugeMetricFamily(metric, f"driver {name}", value=int(value))
            else:
                yield CounterMetricFamily(metric, f"driver {name}", value=int(value))


def prometheus_text(values: Mapping[str, int], prefix: str = "dsh_driver_") -> str:
    """Counters (``_total``) and gauges in the Prometheus exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: values, prefix))
    return generate_latest(registry).decode("utf-8")


class StatusServer(StatusHttpServer):
    """Serves ``/health`` and ``/metrics`` from two callables; start, then close."""

    def __init__(self, health: Health, snapshot: Snapshot,
                 labelled: Rendered | None = None) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(snapshot))
        super().__init__(health, registry, labelled)
