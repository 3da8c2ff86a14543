"""A processors worker's ``/metrics``: its plain delivery counters and gauges, exposed by
``prometheus_client`` and read back by the official parser (names, types, help, values)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pipeline.codec.avro import EventSerde
from pipeline.services.processors.app import build_processors
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.metrics import processors_metrics_text
from pipeline.services.processors.worker import Processors
from pipeline.settings import Settings


def scrape(processors: Processors) -> dict[str, Metric]:
    text = processors_metrics_text(processors)
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_counters_and_gauges_are_exposed_at_each_scrape(tmp_path: Path) -> None:
    processors = build_processors(Settings(state_dir=str(tmp_path)), EventSerde().decode)
    processors.counters.records += 3
    processors.counters.dead_letters += 1
    first = scrape(processors)
    processors.counters.records += 2
    second = scrape(processors)

    counters = {n: f for n, f in second.items() if f.type == "counter"}
    assert set(counters) == {f"dsh_processors_{name}" for name in DeliveryCounters.help_texts()}
    assert all(f.documentation for f in counters.values())
    values = {s.name: s.value for f in counters.values() for s in f.samples}
    assert values["dsh_processors_records_total"] == 5   # read at the scrape, not cached
    assert values["dsh_processors_dead_letters_total"] == 1
    assert first["dsh_processors_records"].samples[0].value == 3

    gauges = {n: f for n, f in second.items() if f.type == "gauge"}
    assert set(gauges) == {f"dsh_processors_{name}" for name in (
        "in_recovery", "recovery_remaining_offsets", "partitions_owned", "sessions",
        "turns_in_flight", "steps_in_flight", "pending_approvals")}
    replicas = {s.labels["replica"]: s.value
                for s in gauges["dsh_processors_recovery_remaining_offsets"].samples}
    assert replicas == {"active": 0, "standby": 0}
    assert gauges["dsh_processors_partitions_owned"].samples[0].value == 0  # not started
