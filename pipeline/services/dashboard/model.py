"""What the dashboard knows: every session's row and the chart series.

:class:`FleetModel` holds:

- one row per session, from the processors' compacted outputs: its ``fleet`` status (state,
  turn/step, last end reason, last activity, counts) and its ``usage`` totals
  (``session/<id>`` records). Nothing of a row is folded from session events, so the rows
  are right however little of the session topic the dashboard reads;
- the tokens chart from the ``usage`` topic's minute windows (by provider/model);
- usage and cost by tenant and provider/model, summed over the ``usage`` topic's cost-ledger
  rows (``tenant/...`` keys, :mod:`pipeline.core.ledger`): ``/api/usage`` and the
  ``dsh_dashboard_tenant_*`` metrics;
- from the live tail of the session topic only (never its history): time buckets by *event*
  time (turn end reasons, tool results and tool errors), recent step/turn/provider latencies
  for p50/p95/p99, the model and title a session last announced, and the Prometheus metrics
  of what was read (events, turns, steps, provider latency and errors, consumer lag).

Synchronous and clock-free: the caller passes ``now_ms``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pipeline.codec.output_views import OutputChange
from pipeline.codec.records import SourcePosition
from pipeline.core.events import Event, JsonValue
from pipeline.core.fleet import IN_TURN
from pipeline.core.ledger import KIND as LEDGER_KIND
from pipeline.core.ledger import LedgerLine
from pipeline.core.lifecycle import end_reason_kind
from pipeline.core.prices import NANOS
from pipeline.services.dashboard.samples import RecentSamples

TOKEN_BUCKET_MS: Final = 60_000     # the processors' "minute" usage windows
TOKEN_HISTORY_MS: Final = 30 * 60_000
EVENT_BUCKET_MS: Final = 10_000
HISTORY_MS: Final = 300_000
LATENCY_SPAN_MS: Final = 120_000
LATENCY_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
INPUT: Final = "gen_ai.usage.input_tokens"     # cache reads and writes included
OUTPUT: Final = "gen_ai.usage.output_tokens"
PROVIDER: Final = "gen_ai.provider.name"
MODEL: Final = "gen_ai.request.model"
# The token directions of the tenant metrics, and the ledger line's count for each.
TENANT_DIRECTIONS: Final = (("input", "input_tokens"), ("cached_input", "cached_input_tokens"),
                            ("cache_write", "cache_write_tokens"), ("output", "output_tokens"))



class Ends(Protocol):
    """A partition's two ends (:class:`pipeline.adapters.metrics.consumer_lag.PartitionEnds`)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def stable(self) -> int: ...
    @property
    def unstable(self) -> int: ...


@dataclass(slots=True)
class TimeBuckets:
    """Sums per (bucket of ``bucket_ms`` by event time, key), for the last ``history_ms``."""

    bucket_ms: int
    history_ms: int = HISTORY_MS
    buckets: dict[int, dict[str, float]] = field(default_factory=dict)

    def add(self, time_ms: int, key: str, amount: float = 1.0) -> None:
        start = time_ms - time_ms % self.bucket_ms
        bucket = self.buckets.setdefault(start, {})
        bucket[key] = bucket.get(key, 0.0) + amount

    def put(self, start: int, key: str, amount: float) -> None:
        self.buckets.setdefault(start - start % self.bucket_ms, {})[key] = amount

    def series(self, now_ms: int) -> list[list[Any]]:
        """``[[bucket start ms, {key: sum}], ...]`` oldest first, empty buckets included."""
        first = now_ms - now_ms % self.bucket_ms - self.history_ms
        for start in [s for s in self.buckets if s < first]:
            del self.buckets[start]
        return [[start, self.buckets.get(start, {})]
                for start in range(first + self.bucket_ms, now_ms + 1, self.bucket_ms)]


@dataclass(slots=True)
class SessionRow:
    """One session on the fleet page: its published status and usage, plus what the live
    tail told about it (model, title)."""

    session_id: str
    status: dict[str, JsonValue] = field(default_factory=dict)
    usage: dict[str, JsonValue] = field(default_factory=dict)
    partition: int = -1
    title: str | None = None
    model: str | None = None
    source: SourcePosition | None = None  # the fleet status's source position

    @property
    def state(self) -> JsonValue:
        return self.status.get("state", "idle")

    def to_json(self) -> dict[str, JsonValue]:
        row: dict[str, JsonValue] = {"session_id": self.session_id, "state": "idle"}
        row.update(self.status)
        row.update({"partition": self.partition, "title": self.title, "model": self.model,
                    "input_tokens": _int(self.usage.get(INPUT)),
                    "output_tokens": _int(self.usage.get(OUTPUT))})
        return row


@dataclass(slots=True)
class LiveTiming:
    """When a session's current turn, step and model call started (live tail only)."""

    turn_started_ms: int | None = None
    step_started_ms: int | None = None
    attempt_started_ms: int | None = None


class DashboardMetrics:
    """The dashboard's ``/metrics`` (a ``prometheus_client`` registry of its own): what it
    read and what it saw in the stream."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.events = Counter("dsh_dashboard_events_read", "Session events read (live tail)",
                              ("type",), registry=r)
        self.turns = Counter("dsh_dashboard_turns_ended", "Turns ended, by end reason",
                             ("reason",), registry=r)
        self.steps = Counter("dsh_dashboard_steps_ended", "Steps ended", registry=r)
        self.tokens = Counter("dsh_dashboard_tokens", "Tokens by provider, model and direction",
                              ("provider", "model", "direction"), registry=r)
        self.provider_latency = Histogram(
            "dsh_dashboard_provider_call_seconds",
            "Model call time, request to finish (event times)", ("provider", "model"),
            buckets=LATENCY_BUCKETS, registry=r)
        self.provider_errors = Counter("dsh_dashboard_provider_errors", "Failed model calls",
                                       ("provider", "model", "code"), registry=r)
        self.tool_results = Counter("dsh_dashboard_tool_results", "Tool results", ("error",),
                                    registry=r)
        self.sessions = Gauge("dsh_dashboard_sessions", "Sessions seen", registry=r)
        self.turns_in_flight = Gauge("dsh_dashboard_turns_in_flight",
                                     "Sessions inside a turn", registry=r)
        self.sse_clients = Gauge("dsh_dashboard_sse_clients", "Open Server-Sent Events streams",
                                 registry=r)
        lag_labels = ("group", "topic", "partition")
        self.lag_records = Gauge("dsh_dashboard_consumer_lag_records", "Records behind the end",
                                 lag_labels, registry=r)
        self.lag_seconds = Gauge("dsh_dashboard_consumer_lag_seconds",
                                 "Age of the oldest unread record", lag_labels, registry=r)
        # Lag counts to the last stable offset: a transaction left open reads as no lag while
        # every reader waits below it. These two show it (alert DshTransactionHanging).
        self.stable_offset = Gauge("dsh_dashboard_partition_stable_offset",
                                   "Last stable offset (the end read_committed readers reach)",
                                   ("topic", "partition"), registry=r)
        self.unstable_records = Gauge("dsh_dashboard_partition_unstable_records",
                                      "Records between the last stable offset and the high "
                                      "watermark (in transactions not ended yet)",
                                      ("topic", "partition"), registry=r)
        self.undecodable = Counter("dsh_dashboard_undecodable_records",
                                   "Records that could not be decoded, by topic", ("topic",),
                                   registry=r)
        self.output_records = Counter("dsh_dashboard_output_records",
                                      "Records read from the processors' outputs", ("topic",),
                                      registry=r)
        self.feed_offset = Gauge("dsh_dashboard_feed_position",
                                 "Next offset the dashboard reads", ("partition",), registry=r)
        self.feed_errors = Counter("dsh_dashboard_tail_errors",
                                   "Distinct problems of the session-topic tail (retried)",
                                   registry=r)
        tenant_labels = ("tenant", "provider", "model")
        self.tenant_tokens = Counter(
            "dsh_dashboard_tenant_tokens", "Tokens by tenant, provider, model and direction "
            "(input, cached_input, cache_write, output), from the cost ledger",
            (*tenant_labels, "direction"), registry=r)
        self.tenant_cost = Counter(
            "dsh_dashboard_tenant_cost", "Cost of the priced calls by tenant, provider and "
            "model, in the price table's currency (docs/costs.md)", tenant_labels, registry=r)
        self.tenant_unpriced = Counter(
            "dsh_dashboard_tenant_unpriced_calls", "Calls without a price (not in the cost)",
            tenant_labels, registry=r)
        self.processors = Gauge("dsh_dashboard_processors_workers",
                                "Members of the processors' consumer group (-1: unknown)",
                                registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)


class FleetModel:
    """Rows from the outputs, charts from the outputs and the live tail (see the module doc)."""

    def __init__(self) -> None:
        self.rows: dict[str, SessionRow] = {}
        self.changed: set[str] = set()
        self.metrics = DashboardMetrics()
        self.tokens = TimeBuckets(TOKEN_BUCKET_MS, history_ms=TOKEN_HISTORY_MS)
        self.model_totals: dict[tuple[str, str, str], float] = {}
        self.ledger: dict[str, LedgerLine] = {}   # ledger key -> its last row
        self.end_reasons = TimeBuckets(EVENT_BUCKET_MS)
        self.tool_results = TimeBuckets(EVENT_BUCKET_MS)
        self.step_latency = RecentSamples(LATENCY_SPAN_MS)
        self.turn_latency = RecentSamples(LATENCY_SPAN_MS)
        self.timing: dict[str, LiveTiming] = {}
        self.in_flight: list[list[int]] = []
        self.lag: list[dict[str, JsonValue]] = []

    def _row(self, session_id: str) -> SessionRow:
        row = self.rows.get(session_id)
        if row is None:
            row = self.rows[session_id] = SessionRow(session_id)
        return row

    # --- the processors' outputs -------------------------------------------------------

    def apply_fleet(self, change: OutputChange) -> None:
        """One ``fleet`` record: the session's status (a tombstone drops the row)."""
        if change.value is None:
            if self.rows.pop(change.key, None) is not None:
                self.changed.add(change.key)
            return
        row = self._row(change.key)
        row.status = dict(change.value)
        if change.source is not None:
            row.partition = change.source.partition
            row.source = change.source
        self.changed.add(change.key)

    def apply_usage(self, change: OutputChange) -> None:
        """One ``usage`` record: a session's totals, a model's totals or a window's sums."""
        kind, _, rest = change.key.partition("/")
        value = change.value or {}
        if kind == "session" and rest:
            self._row(rest).usage = dict(value)
            self.changed.add(rest)
        elif kind == "window" and value.get("granularity") == "minute":
            start = _int(value.get("startMs"))
            label = f"{value.get(PROVIDER)}/{value.get(MODEL)}"
            self.tokens.put(start, label, float(_int(value.get(INPUT)) + _int(value.get(OUTPUT))))
        elif kind == "model" and value:
            self._model_totals(value)
        elif kind == LEDGER_KIND and value:
            self._ledger_row(change.key, value)

    def _ledger_row(self, key: str, value: Mapping[str, JsonValue]) -> None:
        """A cost-ledger row: kept, and what it grew by counted in the tenant metrics (a
        row only grows; a repeat after a crash is equal and counts nothing)."""
        try:
            line = LedgerLine.from_record(value)
        except ValueError:
            self.metrics.undecodable.labels(topic="usage").inc()
            return
        old = self.ledger.get(key)
        self.ledger[key] = line
        labels = {"tenant": line.tenant, "provider": line.provider, "model": line.model}
        for direction, name in TENANT_DIRECTIONS:
            grew = getattr(line, name) - (getattr(old, name) if old else 0)
            if grew > 0:
                self.metrics.tenant_tokens.labels(direction=direction, **labels).inc(grew)
        cost = (line.cost_nanos or 0) - ((old.cost_nanos or 0) if old else 0)
        if cost > 0:
            self.metrics.tenant_cost.labels(**labels).inc(cost / NANOS)
        unpriced = line.unpriced_calls - (old.unpriced_calls if old else 0)
        if unpriced > 0:
            self.metrics.tenant_unpriced.labels(**labels).inc(unpriced)

    def tenant_usage(self, since_ms: int | None = None) -> list[dict[str, JsonValue]]:
        """Usage and cost by tenant and provider/model (hours starting at or after
        ``since_ms``, or all), summed over the ledger rows: tokens, calls, ``costNanos``
        (null when no call had a price), ``unpricedCalls``, ``hours`` (rows summed)."""
        sums: dict[tuple[str, str, str], dict[str, Any]] = {}
        for line in self.ledger.values():
            if since_ms is not None and line.start_ms < since_ms:
                continue
            row = sums.setdefault((line.tenant, line.provider, line.model), {
                "tenant": line.tenant, "provider": line.provider, "model": line.model,
                "inputTokens": 0, "cachedInputTokens": 0, "cacheWriteTokens": 0,
                "outputTokens": 0, "calls": 0, "costNanos": None, "unpricedCalls": 0,
                "hours": 0})
            for name, count in (("inputTokens", line.input_tokens),
                                ("cachedInputTokens", line.cached_input_tokens),
                                ("cacheWriteTokens", line.cache_write_tokens),
                                ("outputTokens", line.output_tokens), ("calls", line.calls),
                                ("unpricedCalls", line.unpriced_calls), ("hours", 1)):
                row[name] += count
            if line.cost_nanos is not None:
                row["costNanos"] = (row["costNanos"] or 0) + line.cost_nanos
        return [sums[key] for key in sorted(sums)]

    def _model_totals(self, value: Mapping[str, JsonValue]) -> None:
        labels = {"provider": str(value.get(PROVIDER)), "model": str(value.get(MODEL))}
        for direction, name in (("input", INPUT), ("output", OUTPUT)):
            key = (labels["provider"], labels["model"], direction)
            total = float(_int(value.get(name)))
            grew = total - self.model_totals.get(key, 0.0)
            if grew > 0:  # a counter: totals only grow (a repeat after a crash is equal)
                self.metrics.tokens.labels(direction=direction, **labels).inc(grew)
                self.model_totals[key] = total

    # --- the live tail of the session topic --------------------------------------------

    def apply_event(self, session_id: str, event: Event) -> None:
        """One live session event: charts, latencies, metrics; the row's model and title."""
        data = event.data if isinstance(event.data, Mapping) else {}
        self.metrics.events.labels(type=event.type).inc()
        timing = self.timing.setdefault(session_id, LiveTiming())
        self._timing(session_id, timing, event, data)
        if event.type == "session/title" and isinstance(data.get("title"), str):
            self._row(session_id).title = str(data["title"])
            self.changed.add(session_id)
        elif event.type == "request/header":
            header = data.get("header")
            config = header.get("config") if isinstance(header, Mapping) else None
            if isinstance(config, Mapping) and config.get("provider") and config.get("model"):
                self._row(session_id).model = f"{config['provider']}/{config['model']}"
                self.changed.add(session_id)

    def _timing(self, session_id: str, timing: LiveTiming, event: Event,
                data: Mapping[str, JsonValue]) -> None:
        kind, at = event.type, event.time
        if kind == "turn/start":
            timing.turn_started_ms = at
        elif kind == "turn/end":
            self._turn_end(timing, at, data)
        elif kind in ("step/start", "llm/retry-started"):
            timing.attempt_started_ms = at
            if kind == "step/start":
                timing.step_started_ms = at
        elif kind == "step/end":
            self.metrics.steps.inc()
            if timing.step_started_ms is not None:
                self.step_latency.add(at, max(0, at - timing.step_started_ms) / 1000)
                timing.step_started_ms = None
        elif kind == "assistant/chunk":
            self._chunk(session_id, timing, at, data)
        elif kind == "tool/result":
            failed = isinstance(data.get("error"), Mapping)
            self.tool_results.add(at, "error" if failed else "ok")
            self.metrics.tool_results.labels(error=str(failed).lower()).inc()

    def _turn_end(self, timing: LiveTiming, at: int, data: Mapping[str, JsonValue]) -> None:
        kind = end_reason_kind(data.get("reason"))
        label = "unknown" if kind is None else kind  # an empty kind stays a label of its own
        self.end_reasons.add(at, label)
        self.metrics.turns.labels(reason=label).inc()
        if timing.turn_started_ms is not None:
            self.turn_latency.add(at, max(0, at - timing.turn_started_ms) / 1000)
            timing.turn_started_ms = None

    def _chunk(self, session_id: str, timing: LiveTiming, at: int,
               data: Mapping[str, JsonValue]) -> None:
        chunk = data.get("chunk")
        if not isinstance(chunk, Mapping) or chunk.get("type") != "finish":
            return
        row = self.rows.get(session_id)
        provider, _, model = ((row.model if row else None) or "unknown/unknown").partition("/")
        labels = {"provider": provider, "model": model}
        if timing.attempt_started_ms is not None:
            seconds = max(0, at - timing.attempt_started_ms) / 1000
            self.metrics.provider_latency.labels(**labels).observe(seconds)
            timing.attempt_started_ms = None
        reason = chunk.get("reason")
        if isinstance(reason, Mapping) and reason.get("kind") == "error":
            failure = reason.get("failure")
            code = failure.get("code") if isinstance(failure, Mapping) else None
            self.metrics.provider_errors.labels(code=str(code or "unknown"), **labels).inc()

    # --- what the pages get ------------------------------------------------------------

    def take_changed(self) -> list[dict[str, JsonValue]]:
        """The rows changed since the last call (for the live fleet stream)."""
        rows = [self.rows[s].to_json() for s in sorted(self.changed) if s in self.rows]
        self.changed.clear()
        return rows

    def snapshot_rows(self) -> list[dict[str, JsonValue]]:
        return [row.to_json() for _, row in sorted(self.rows.items())]

    def tick(self, now_ms: int) -> None:
        """Sample the gauges (once a second): turns in flight, sessions."""
        in_turn = sum(1 for row in self.rows.values() if row.state == IN_TURN)
        self.in_flight.append([now_ms, in_turn])
        cutoff = now_ms - HISTORY_MS
        while self.in_flight and self.in_flight[0][0] < cutoff:
            self.in_flight.pop(0)
        self.metrics.turns_in_flight.set(in_turn)
        self.metrics.sessions.set(len(self.rows))

    def charts(self, now_ms: int) -> dict[str, JsonValue]:
        """Every chart's data as of ``now_ms`` (what ``/api/charts`` and the stream send)."""
        results = self.tool_results.series(now_ms)
        return {
            "now": now_ms,
            "tokens": self.tokens.series(now_ms),
            "tokenBucketMs": TOKEN_BUCKET_MS,
            "inFlight": list(self.in_flight),
            "endReasons": self.end_reasons.series(now_ms),
            "eventBucketMs": EVENT_BUCKET_MS,
            "toolErrorRate": [[start, _rate(sums)] for start, sums in results],
            "latency": {"step": self.step_latency.quantiles(now_ms),
                        "turn": self.turn_latency.quantiles(now_ms),
                        "quantiles": [0.5, 0.95, 0.99]},
            "lag": list(self.lag),
        }

    def set_partition_ends(self, ends: Sequence[Ends]) -> None:
        """Each partition's last stable offset and records above it (see the gauges)."""
        for gauge in (self.metrics.stable_offset, self.metrics.unstable_records):
            gauge.clear()   # partitions that are gone leave the exposition
        for end in ends:
            labels = {"topic": end.topic, "partition": str(end.partition)}
            self.metrics.stable_offset.labels(**labels).set(end.stable)
            self.metrics.unstable_records.labels(**labels).set(end.unstable)

    def set_lag(self, samples: list[dict[str, JsonValue]]) -> None:
        self.lag = samples
        pairs = [({"group": str(s["group"]), "topic": str(s["topic"]),
                   "partition": str(s["partition"])}, s) for s in samples]
        for gauge, field_name in ((self.metrics.lag_records, "records"),
                                  (self.metrics.lag_seconds, "seconds")):
            gauge.clear()  # groups and partitions that are gone leave the exposition
            for labels, sample in pairs:
                gauge.labels(**labels).set(float(str(sample[field_name])))


def _int(value: JsonValue | None) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _rate(sums: Mapping[str, float]) -> float | None:
    total = sums.get("ok", 0.0) + sums.get("error", 0.0)
    return None if total == 0 else sums.get("error", 0.0) / total
