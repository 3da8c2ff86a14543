"""The driver's labelled metrics: provider latency and errors, turns and steps, on /metrics."""

from __future__ import annotations

import asyncio
import itertools
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pipeline.adapters.llm.scripted import ScriptedError, ScriptedProvider, ScriptedReply
from pipeline.core.inbox import FollowUp
from pipeline.core.model import ModelRequest, RetryPolicy
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.http_status import StatusServer
from pipeline.services.driver.metrics import RunnerMetrics
from pipeline.services.driver.partition import DriverMetrics
from pipeline.services.driver.runner import Driver
from pipeline.services.driver.tools import builtin_registry


def fail_once_then_answer(request: ModelRequest, attempt: int) -> ScriptedReply:
    if attempt == 1:
        return ScriptedReply(error=ScriptedError("SERVER", status=503))
    return ScriptedReply(text="hello")


def samples(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(found: list[Sample], name: str, **labels: str) -> float:
    matching = [s.value for s in found if s.name == name and s.labels == labels]
    assert len(matching) == 1, f"{name}{labels}: {len(matching)} samples"
    return matching[0]


async def test_a_failed_then_retried_call_shows_on_metrics() -> None:
    ticks = itertools.count()
    metrics = DriverMetrics(commands=1, runner=RunnerMetrics(
        monotonic=lambda: 0.25 * next(ticks)))  # each call spans one tick: 0.25 s
    provider = ScriptedProvider(fail_once_then_answer)
    driver = Driver(provider_factory=lambda _p, _m: provider, tools=builtin_registry(),
                    config=SessionConfig("scripted", "m-1"), jitter=lambda: 0.0,
                    retry=RetryPolicy(max_attempts=3, base_ms=1, max_ms=2),
                    metrics=metrics.runner)
    driver.submit(FollowUp("s1", "m1", ({"type": "text", "text": "hi"},)))
    await driver.drain()

    server = StatusServer(lambda: (True, {}), metrics.snapshot, metrics.runner.render)
    port = await server.start("127.0.0.1", 0)
    try:
        with await asyncio.to_thread(urllib.request.urlopen,
                                     f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = (await asyncio.to_thread(answer.read)).decode()
    finally:
        await server.close()

    found = samples(text)
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
