"""The processors worker's ``/metrics``, by ``prometheus_client``: the delivery counters
(``dsh_processors_<name>_total``), plus gauges for recovery progress (offsets left to restore
from the changelogs), partitions owned and the fleet this worker owns (sessions, turns and
steps in flight).

The worker counts in plain integers (:class:`DeliveryCounters`); :class:`ProcessorsCollector`
reads them, and the gauges, at each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.worker import Processors

PREFIX: Final = "dsh_processors_"
FLEET_GAUGES: Final = (("sessions", "Sessions this worker owns"),
                       ("turns_in_flight", "Owned sessions inside a turn"),
                       ("steps_in_flight", "Owned sessions inside a step"),
                       ("pending_approvals",
                        "Owned sessions whose tool call waits for a person's approval"))


class ProcessorsCollector(Collector):
    """The worker's counters and gauges as they are at each scrape."""

    def __init__(self, processors: Processors) -> None:
        self._processors = processors

    def collect(self) -> Iterator[Metric]:
        processors = self._processors
        counts = processors.counters.to_json()
        for name, help_text in DeliveryCounters.help_texts().items():
            yield CounterMetricFamily(f"{PREFIX}{name}", help_text, value=counts[name])
        recovery = processors.recovery()
        yield GaugeMetricFamily(f"{PREFIX}in_recovery",
                                "1 while tables are being restored from changelogs",
                                value=1 if recovery["in_recovery"] else 0)
        remaining = GaugeMetricFamily(f"{PREFIX}recovery_remaining_offsets",
                                      "Changelog offsets left to restore", labels=["replica"])
        remaining.add_metric(["active"], recovery["active_remaining"])
        remaining.add_metric(["standby"], recovery["standby_remaining"])
        yield remaining
        owned = processors.active_partitions(processors.settings.topics.session_events)
        yield GaugeMetricFamily(f"{PREFIX}partitions_owned",
                                "Session-topic partitions this worker owns", value=len(owned))
        summary = processors.fleet_summary()
        for name, help_text in FLEET_GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}{name}", help_text, value=float(summary[name]))


def processors_registry(processors: Processors) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProcessorsCollector(processors))
    return registry


def processors_metrics_text(processors: Processors) -> str:
    """The worker's metrics in the Prometheus text format (0.0.4)."""
    return generate_latest(processors_registry(processors)).decode("utf-8")
