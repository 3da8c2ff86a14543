"""The GenAI client histograms (semantic conventions v1.41.0) on the driver's /metrics and
the otel service's: token sums per type equal core's usage scan of the same log, the
conventions' bucket boundaries, durations per call with error.type on failures."""

from __future__ import annotations

from driver_metrics_support import samples, scrape, scripted_driver, ticking_metrics
from prometheus_client.samples import Sample
from shared_paths import SHARED_DIR

from pipeline.adapters.metrics.genai import DURATION_BUCKETS, TOKEN_BUCKETS
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.genai_spans import SessionTraces, build_spans
from pipeline.core.inbox import FollowUp
from pipeline.core.usage import UsageScan
from pipeline.services.driver.memory import MemorySink
from pipeline.services.otel.metrics import OtelMetrics

FIXTURES = SHARED_DIR / "fixtures" / "dsh-format0"


def total(found: list[Sample], name: str, **labels: str) -> float:
    return sum(s.value for s in found
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def buckets(found: list[Sample], name: str) -> set[float]:
    return {float(s.labels["le"]) for s in found
            if s.name == name and s.labels["le"] != "+Inf"}


async def test_driver_metrics_carry_genai_histograms_matching_core_usage() -> None:
    metrics = ticking_metrics()
    sink = MemorySink()
    driver = scripted_driver(metrics, sink)
    for n in range(3):
        driver.submit(FollowUp("s1", f"m{n}", ({"type": "text", "text": "hi " * (n + 1)},)))
    await driver.drain()
    found = await scrape(metrics)
    scan = UsageScan()
    scan.add_log("s1", sink.events["s1"])
    expected = scan.by_session["s1"].otel_attributes()
    assert expected["gen_ai.usage.output_tokens"] > 0
    for kind in ("input", "output"):
        assert total(found, "gen_ai_client_token_usage_sum", gen_ai_token_type=kind,
                     gen_ai_provider_name="scripted", gen_ai_request_model="m-1"
                     ) == expected[f"gen_ai.usage.{kind}_tokens"]
    duration = "gen_ai_client_operation_duration_seconds_count"
    retries = sum(1 for e in sink.events["s1"] if e.type == "llm/retry")
    assert retries == 3 and total(found, duration, error_type="SERVER") == retries
    assert total(found, duration, error_type="") == scan.by_session["s1"].calls
    assert buckets(found, "gen_ai_client_token_usage_bucket") == set(map(float, TOKEN_BUCKETS))
    assert buckets(found, "gen_ai_client_operation_duration_seconds_bucket") == set(
        DURATION_BUCKETS)


def test_otel_service_metrics_from_exported_chat_spans() -> None:
    metrics = OtelMetrics()
    scan = UsageScan()
    for path in sorted(FIXTURES.glob("*.jsonl")):
        events = read_session_file(path).events
        scan.add_log(path.stem, events)
        traces = SessionTraces(path.stem)
        for position, event in enumerate(events):
            turn = traces.add(event, position)
            if turn is not None:
                metrics.chat_spans(build_spans(turn))
    found = samples(metrics.registry_text())
    for kind in ("input", "output"):
        assert total(found, "gen_ai_client_token_usage_sum", gen_ai_token_type=kind) == sum(
            c.otel_attributes()[f"gen_ai.usage.{kind}_tokens"]
            for c in scan.by_session.values())
