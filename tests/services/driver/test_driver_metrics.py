"""The driver's labelled metrics: provider latency and errors, turns and steps, on /metrics."""

from __future__ import annotations

from driver_metrics_support import scrape, scripted_driver, ticking_metrics
from prometheus_client.samples import Sample

from pipeline.core.inbox import FollowUp


def value(found: list[Sample], name: str, **labels: str) -> float:
    matching = [s.value for s in found if s.name == name and s.labels == labels]
    assert len(matching) == 1, f"{name}{labels}: {len(matching)} samples"
    return matching[0]


async def test_a_failed_then_retried_call_shows_on_metrics() -> None:
    metrics = ticking_metrics(commands=1)  # each call spans one tick: 0.25 s
    driver = scripted_driver(metrics)
    driver.submit(FollowUp("s1", "m1", ({"type": "text", "text": "hi"},)))
    await driver.drain()

    found = await scrape(metrics)
    call = {"provider": "scripted", "model": "m-1"}
    assert value(found, "dsh_driver_provider_call_seconds_count", **call) == 2
    assert value(found, "dsh_driver_provider_call_seconds_sum", **call) == 0.5
    assert value(found, "dsh_driver_provider_call_seconds_bucket", le="0.25", **call) == 2
    assert value(found, "dsh_driver_provider_errors_total", code="SERVER", **call) == 1
    assert not [s for s in found if s.labels.get("code") not in (None, "SERVER")]
    assert value(found, "dsh_driver_turns_total", kind="completed") == 1
    assert value(found, "dsh_driver_steps_total") == 1
    assert value(found, "dsh_driver_commands_total") == 1  # the plain counters still there
    assert value(found, "dsh_driver_transactions_aborted_total") == 0
