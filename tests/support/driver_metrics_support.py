"""A driver that runs scripted turns and serves its ``/metrics`` over HTTP, for the tests of
what it exports (tests/services/driver/test_driver_metrics.py,
tests/services/otel/test_genai_metrics.py)."""

from __future__ import annotations

import asyncio
import itertools
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pipeline.adapters.llm.scripted import ScriptedError, ScriptedProvider, ScriptedReply
from pipeline.core.model import ModelRequest, RetryPolicy
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.http_status import StatusServer
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.metrics import RunnerMetrics
from pipeline.services.driver.partition import DriverMetrics
from pipeline.services.driver.tools import builtin_registry

CALL_S = 0.25  # every provider call lasts one tick of the metrics' clock


def fail_once_then_answer(request: ModelRequest, attempt: int) -> ScriptedReply:
    if attempt == 1:
        return ScriptedReply(error=ScriptedError("SERVER", status=503))
    return ScriptedReply(text="hello there")


def ticking_metrics(commands: int = 0) -> DriverMetrics:
    """Driver metrics whose clock moves :data:`CALL_S` at each reading."""
    ticks = itertools.count()
    return DriverMetrics(commands=commands,
                         runner=RunnerMetrics(monotonic=lambda: CALL_S * next(ticks)))


def scripted_driver(metrics: DriverMetrics, sink: MemorySink | None = None) -> Driver:
    """A driver of model ``scripted``/``m-1`` whose every call fails once, then answers."""
    return Driver(provider_factory=lambda _p, _m: ScriptedProvider(fail_once_then_answer),
                  tools=builtin_registry(), sink=sink, config=SessionConfig("scripted", "m-1"),
                  jitter=lambda: 0.0, retry=RetryPolicy(max_attempts=3, base_ms=1, max_ms=2),
                  metrics=metrics.runner)


def samples(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


async def scrape(metrics: DriverMetrics) -> list[Sample]:
    """``GET /metrics`` of the driver's status server over ``metrics``, parsed."""
    server = StatusServer(lambda: (True, {}), metrics.snapshot, metrics.runner.render)
    port = await server.start("127.0.0.1", 0)
    try:
        with await asyncio.to_thread(urllib.request.urlopen,
                                     f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            return samples((await asyncio.to_thread(answer.read)).decode())
    finally:
        await server.close()
