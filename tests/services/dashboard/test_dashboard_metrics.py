"""Latency percentiles, the dashboard's model (rows from the processors' output records,
charts from live events), group labels, what it says of the processors' group and the token
check: pure parts (and one check of that group against an address where no broker listens)."""

from __future__ import annotations

import base64
import logging
from typing import Any

import pytest
from aiokafka.errors import for_code
from dashboard_support import LiveSession, prometheus_samples

from dsh_dev.localstack.process import free_ports
from pipeline.adapters.faust.fetching import worker_consumer_options
from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.records import InboxRecord
from pipeline.adapters.metrics.consumer_lag import PartitionEnds
from pipeline.codec.avro import EventSerde
from pipeline.codec.output_views import OutputView
from pipeline.codec.outputs import (
    FLEET_STATUS,
    USAGE_RECORD,
    OutputDecoder,
    default_output_codecs,
)
from pipeline.codec.records import SourcePosition, source_headers, source_position
from pipeline.core.errors import BrokerError, DshError
from pipeline.core.events import Event
from pipeline.core.fleet import FleetStatus
from pipeline.core.usage import SessionUsage, model_record, session_record, window_record
from pipeline.services.dashboard.model import FleetModel, TimeBuckets
from pipeline.services.dashboard.samples import RecentSamples, percentile
from pipeline.services.dashboard.service import DashboardService, ProcessorsCheck, group_label
from pipeline.services.dashboard.web import token_accepted
from pipeline.services.processors.app import build_processors
from pipeline.settings import Settings


def test_percentiles_by_nearest_rank_over_a_sliding_span() -> None:
    assert percentile([], 0.5) is None
    values = [float(v) for v in range(1, 101)]
    assert [percentile(values, q) for q in (0.5, 0.95, 0.99)] == [50.0, 95.0, 99.0]
    recent = RecentSamples(span_ms=1000)
    recent.add(0, 100.0)
    recent.add(900, 1.0)
    assert recent.quantiles(950, (0.99,)) == [100.0]
    assert recent.quantiles(1500, (0.99,)) == [1.0]  # the old sample left the span


def test_time_buckets_keep_the_history_and_fill_gaps() -> None:
    buckets = TimeBuckets(1000, history_ms=5000)
    buckets.add(1_000, "a", 2)
    buckets.add(9_500, "a", 3)
    series = buckets.series(10_000)
    assert [start for start, _ in series] == [6000, 7000, 8000, 9000, 10000]
    assert series[3] == [9000, {"a": 3}]
    assert 1000 not in buckets.buckets


def _session_with_error_and_tool() -> LiveSession:
    live = LiveSession("s1", provider="deepseek", model="chat-1")
    live.start_turn("hi")
    seqs = live.answer(["a"])
    live.chunk({"type": "finish", "reason": {"kind": "error", "failure": {
        "message": "busy", "code": "RATE_LIMIT"}}})
    live.add("llm/retry-started", {"turn": 1, "step": 1, "attempt": 2})
    live.finish(seqs, "ab", {"inputTokens": 10, "outputTokens": 5, "cacheReadTokens": 4})
    live.add("tool/result", {"turn": 1, "step": 1, "error": {"name": "X", "code": "BOOM"},
                             "message": {"id": "r", "role": "user", "content": []}})
    return live


def _output(topic: str, key: str, value: dict[str, Any] | None, codec: Any,
            offset: int = 0) -> InboxRecord:
    """A record as the processors write it (their Avro codec and source headers)."""
    return InboxRecord(topic, 2, offset, key.encode(), codec.encode(value),
                       source_headers(2, 100 + offset))


def _rows_from_outputs(model: FleetModel, live: LiveSession) -> None:
    """The processors' fleet and usage records of ``live``, folded as the dashboard does."""
    codecs = default_output_codecs()
    status = FleetStatus("s1")
    usage = SessionUsage()
    samples = []
    for event in live.events:
        if event.type != "assistant/chunk":
            status.apply(event)
        sample = usage.apply("s1", event)
        if sample is not None:
            samples.append(sample)
    fleet = OutputView(OutputDecoder(), FLEET_STATUS)
    totals = OutputView(OutputDecoder(), USAGE_RECORD)
    minute = live.events[-1].time - live.events[-1].time % 60_000
    records = [
        (fleet, _output("fleet", "s1", status.to_json(), codecs.fleet)),
        (totals, _output("usage", "session/s1", session_record("s1", usage.totals),
                         codecs.usage, 1)),
        (totals, _output("usage", "model/deepseek/chat-1", model_record(
            "deepseek", "chat-1", usage.totals), codecs.usage, 2)),
        (totals, _output("usage", "window/minute/x", window_record(
            ["minute", minute, minute + 60_000, "deepseek", "chat-1"], usage.totals,
            closed=False), codecs.usage, 3)),
        (fleet, InboxRecord("fleet", 0, 9, b"s1", b"garbage", ())),
    ]
    for view, record in records:
        change = view.apply(record)
        if change is not None and view is fleet:
            model.apply_fleet(change)
        elif change is not None:
            model.apply_usage(change)
    assert fleet.undecodable == 1 and "fleet[0]@9" in fleet.problems[0]
    assert len(samples) == 1


def test_rows_from_the_outputs_charts_from_the_live_events() -> None:
    live = _session_with_error_and_tool()
    model = FleetModel()
    for event in live.events:
        model.apply_event("s1", event)
    _rows_from_outputs(model, live)
    row = model.rows["s1"].to_json()
    assert (row["state"], row["turn"], row["step"]) == ("in-turn", 1, None)
    assert (row["input_tokens"], row["output_tokens"], row["tool_errors"]) == (14, 5, 1)
    assert row["model"] == "deepseek/chat-1" and row["partition"] == 2
    assert model.rows["s1"].source == SourcePosition(2, 100)
    assert [r["session_id"] for r in model.take_changed()] == ["s1"]
    assert model.take_changed() == []
    live.end_turn("error")
    model.apply_event("s1", live.events[-1])
    now = live.events[-1].time
    model.tick(now)
    charts = model.charts(now)
    assert sum(b.get("deepseek/chat-1", 0) for _, b in charts["tokens"]) == 19
    assert sum(b.get("error", 0) for _, b in charts["endReasons"]) == 1
    assert [rate for _, rate in charts["toolErrorRate"] if rate is not None] == [1.0]
    assert all(v is not None for v in charts["latency"]["turn"])
    samples = prometheus_samples(model.metrics.render().decode())
    labels = (("code", "RATE_LIMIT"), ("model", "chat-1"), ("provider", "deepseek"))
    assert samples[("dsh_dashboard_provider_errors_total", labels)] == 1
    assert samples[("dsh_dashboard_provider_call_seconds_count",
                    (("model", "chat-1"), ("provider", "deepseek")))] == 2
    assert samples[("dsh_dashboard_turns_ended_total", (("reason", "error"),))] == 1
    assert samples[("dsh_dashboard_tokens_total", (("direction", "input"), ("model", "chat-1"),
                                                   ("provider", "deepseek")))] == 14


def test_old_windows_do_not_show_as_tokens_now() -> None:
    model = FleetModel()
    live = LiveSession("s1")
    live.start_turn("x")
    live.finish(live.answer(["y"]), "y", {"inputTokens": 100, "outputTokens": 1})
    old = [Event(e.type, e.seq, 1_000, e.data, e.surface_op, e.source_event_seqs)
           for e in live.events]
    live.events = old
    _rows_from_outputs(model, live)
    charts = model.charts(10_000_000)
    assert all(not sums for _, sums in charts["tokens"])


def test_a_partition_s_two_ends_are_gauges_and_a_gone_partition_leaves_them() -> None:
    model = FleetModel()
    model.set_partition_ends([PartitionEnds("t", 0, 100, 112), PartitionEnds("t", 1, 7, 7)])
    samples = prometheus_samples(model.metrics.render().decode())
    at = (("partition", "0"), ("topic", "t"))
    assert samples[("dsh_dashboard_partition_stable_offset", at)] == 100
    assert samples[("dsh_dashboard_partition_unstable_records", at)] == 12
    assert samples[("dsh_dashboard_partition_unstable_records",
                    (("partition", "1"), ("topic", "t")))] == 0
    model.set_partition_ends([PartitionEnds("t", 1, 9, 9)])
    samples = prometheus_samples(model.metrics.render().decode())
    assert ("dsh_dashboard_partition_stable_offset", at) not in samples


def test_group_labels_drop_the_deployment_prefixes() -> None:
    settings = Settings.from_env({}, topic_prefix="dsh.", group_id_prefix="dsh-")
    assert group_label(settings, settings.processors_group()) == "processors"
    assert settings.processors_group() == "dsh-dsh.processors"
    assert group_label(settings, "dsh-driver") == "driver"
    assert group_label(settings, "other") == "other"


def test_the_group_the_dashboard_asks_about_is_the_one_the_workers_join(tmp_path: Any) -> None:
    """``dsh-dsh.processors`` is DSH_GROUP_ID_PREFIX + DSH_TOPIC_PREFIX + "processors", not a
    prefix written twice: the faust app id, which faust's worker consumer joins as its group
    (docs/decisions/processors-group-id.md). Deployed workers use it: it stays."""
    settings = Settings(state_dir=str(tmp_path))
    app = build_processors(settings, EventSerde().decode).app
    assert app.conf.id == settings.processors_group() == "dsh-dsh.processors"
    assert worker_consumer_options(app, app.transport)["group_id"] == "dsh-dsh.processors"


GROUP = "dsh-dsh.processors"


def describe_failure(error: Exception) -> BrokerError:
    """The error the dashboard's check gets when describing the group raised ``error``."""
    with pytest.raises(BrokerError) as raised, broker_errors(f"describe consumer group {GROUP!r}"):
        raise error
    return raised.value


# What a broker answers for a group whose coordinator is not ready: just started (the demo's
# start), loading the group's offsets, or moved to another broker.
STARTING_CODES = [15, 14, 16]


@pytest.mark.parametrize("code", STARTING_CODES, ids=lambda c: for_code(c).__name__)
def test_a_group_coordinator_not_ready_reads_as_starting_until_the_grace_runs_out(
        code: int) -> None:
    check = ProcessorsCheck(grace_ms=60_000)
    error = describe_failure(for_code(code)(f"group {GROUP!r}"))
    level, line = check.failed(error, now_ms=1_000)
    assert level == logging.INFO
    assert "starting), asking again" in line and for_code(code).__name__ in line
    assert "cannot tell" not in line
    assert check.failed(error, now_ms=31_000)[0] == logging.DEBUG  # said once
    assert check.failed(error, now_ms=61_000)[0] == logging.DEBUG  # within the grace
    level, line = check.failed(error, now_ms=62_000)
    assert level == logging.WARNING
    assert line == (f"dashboard: cannot tell whether processors run: describe consumer group "
                    f"{GROUP!r}: {for_code(code).__name__}: [Error {code}] "
                    f"{for_code(code).__name__}: group {GROUP!r} (for 61 s)")
    check.answered()   # an answer: the next transient state is a new start
    assert check.failed(error, now_ms=100_000)[0] == logging.INFO


def test_a_broker_out_of_reach_for_a_moment_is_transient_too() -> None:
    check = ProcessorsCheck(grace_ms=10_000)
    error = describe_failure(ConnectionRefusedError(111, "Connection refused"))
    assert check.failed(error, now_ms=0)[0] == logging.INFO
    assert check.failed(error, now_ms=10_001)[0] == logging.WARNING


async def test_the_dashboards_check_says_starting_once_and_shows_unknown(
        caplog: pytest.LogCaptureFixture) -> None:
    """The service's own check, against an address where no broker listens (refused at once):
    a transient failure, said once at info level; the processors unknown (-1), not 0."""
    (port,) = free_ports(1)
    service = DashboardService(Settings(bootstrap_servers=f"127.0.0.1:{port}"),
                               EventSerde().decode)
    with caplog.at_level(logging.DEBUG, logger="pipeline.services.dashboard.service"):
        await service._check_processors()
        await service._check_processors()
    said = [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "pipeline.services.dashboard.service"]
    assert [level for level, _ in said] == [logging.INFO, logging.DEBUG]
    assert "starting), asking again: connect to 127.0.0.1" in said[0][1]
    assert service.processors_workers is None and service.processors_error is None
    samples = prometheus_samples(service.model.metrics.render().decode())
    assert samples[("dsh_dashboard_processors_workers", ())] == -1


@pytest.mark.parametrize("error", [
    describe_failure(for_code(30)(f"group {GROUP!r}")),   # may not Describe it: never "starting"
    DshError("something else"),
], ids=["refused", "not-a-broker-error"])
def test_other_failures_are_warnings_at_once(error: DshError) -> None:
    check = ProcessorsCheck(grace_ms=60_000)
    level, line = check.failed(error, now_ms=0)
    assert level == logging.WARNING
    assert line == f"dashboard: cannot tell whether processors run: {error}"


@pytest.mark.parametrize(("header", "ok"), [
    ("Bearer s3cret", True), ("bearer  s3cret ", True), ("Bearer wrong", False),
    ("Basic " + base64.b64encode(b"anyone:s3cret").decode(), True),
    ("Basic " + base64.b64encode(b"s3cret:nope").decode(), False),
    ("Basic !!!", False), ("Token s3cret", False), ("", False), (None, False),
])
def test_token_accepted_as_bearer_or_basic_password(header: str | None, ok: bool) -> None:
    assert token_accepted(header, "s3cret") is ok


@pytest.mark.parametrize(("headers", "expected"), [
    (source_headers(2, 17), SourcePosition(2, 17)),
    ((("dsh.source.partition", b"x"), ("dsh.source.offset", b"1")), None),
    ((("dsh.source.offset", b"1"),), None),
    ((("dsh.source.partition", b"-1"), ("dsh.source.offset", b"1")), None),
    ((("dsh.source.partition", None), ("dsh.source.offset", b"1")), None),
    (None, None),
])
def test_source_positions_are_read_back_or_none(headers: Any, expected: Any) -> None:
    assert source_position(headers) == expected
