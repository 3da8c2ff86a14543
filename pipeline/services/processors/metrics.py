"""The processors worker's ``/metrics``: the delivery counters, plus gauges for recovery
progress (offsets left to restore from the changelogs), partitions owned and the fleet this
worker owns (sessions, turns and steps in flight), in the Prometheus text format."""

from __future__ import annotations

from pipeline.core.metrics import MetricsRegistry
from pipeline.services.processors.worker import Processors


def processors_metrics_text(processors: Processors) -> str:
    registry = MetricsRegistry(prefix="dsh_processors_")
    recovery = processors.recovery()
    registry.gauge("in_recovery", "1 while tables are being restored from changelogs").set(
        1 if recovery["in_recovery"] else 0)
    remaining = registry.gauge("recovery_remaining_offsets",
                               "Changelog offsets left to restore", ("replica",))
    remaining.set(recovery["active_remaining"], replica="active")
    remaining.set(recovery["standby_remaining"], replica="standby")
    registry.gauge("partitions_owned", "Session-topic partitions this worker owns").set(
        len(processors.active_partitions(processors.settings.topics.session_events)))
    summary = processors.fleet_summary()
    for name, help_text in (("sessions", "Sessions this worker owns"),
                            ("turns_in_flight", "Owned sessions inside a turn"),
                            ("steps_in_flight", "Owned sessions inside a step")):
        registry.gauge(name, help_text).set(float(summary[name]))
    return processors.counters.prometheus() + registry.render()
