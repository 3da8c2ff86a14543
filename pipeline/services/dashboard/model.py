"""What the dashboard knows: every session's row and the chart series, folded from events.

:class:`FleetModel` folds each session event read from the session topic (any order across
sessions, in order within one) with the core folds (:class:`FleetStatus`, :class:`SessionUsage`)
and keeps:

- one row per session (state, turn/step, last end reason, last activity, tokens, errors);
- time buckets by *event* time (tokens by provider/model, turn end reasons, tool results and
  tool errors), so catching up on old events never shows as a spike "now";
- recent step/turn/provider latencies (from event times) for p50/p95/p99;
- the Prometheus metrics of the dashboard (events read, turns, steps, provider latency and
  errors by code, consumer lag).

Synchronous and clock-free: the caller passes ``now_ms``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from pipeline.core.events import Event, JsonValue
from pipeline.core.fleet import IN_TURN, FleetStatus
from pipeline.core.metrics import MetricsRegistry, RecentSamples
from pipeline.core.usage import UNKNOWN, SessionUsage

TOKEN_BUCKET_MS: Final = 1_000
EVENT_BUCKET_MS: Final = 10_000
HISTORY_MS: Final = 300_000
LATENCY_SPAN_MS: Final = 120_000
LATENCY_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


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

    def series(self, now_ms: int) -> list[list[Any]]:
        """``[[bucket start ms, {key: sum}], ...]`` oldest first, empty buckets included."""
        first = now_ms - now_ms % self.bucket_ms - self.history_ms
        for start in [s for s in self.buckets if s < first]:
            del self.buckets[start]
        return [[start, self.buckets.get(start, {})]
                for start in range(first + self.bucket_ms, now_ms + 1, self.bucket_ms)]


@dataclass(slots=True)
class SessionRow:
    """One session on the fleet page."""

    status: FleetStatus
    usage: SessionUsage = field(default_factory=SessionUsage)
    partition: int = -1
    title: str | None = None
    turn_started_ms: int | None = None
    step_started_ms: int | None = None
    attempt_started_ms: int | None = None

    def to_json(self) -> dict[str, JsonValue]:
        totals = self.usage.totals
        row = self.status.to_json()
        row.update({
            "partition": self.partition, "title": self.title,
            "input_tokens": totals.input_tokens + totals.cache_read_tokens
            + totals.cache_write_tokens,
            "output_tokens": totals.output_tokens,
            "model": "/".join(self.usage.last_model) if self.usage.last_model else None,
        })
        return row

    def model_labels(self) -> dict[str, str]:
        provider, model = self.usage.last_model or (UNKNOWN, UNKNOWN)
        return {"provider": provider, "model": model}


class DashboardMetrics:
    """The dashboard's ``/metrics``: what it read and what it saw in the stream."""

    def __init__(self) -> None:
        r = self.registry = MetricsRegistry(prefix="dsh_dashboard_")
        self.events = r.counter("events_read_total", "Session events read", ("type",))
        self.turns = r.counter("turns_ended_total", "Turns ended, by end reason", ("reason",))
        self.steps = r.counter("steps_ended_total", "Steps ended")
        self.tokens = r.counter("tokens_total", "Tokens by provider, model and direction",
                                ("provider", "model", "direction"))
        self.provider_latency = r.histogram(
            "provider_call_seconds", "Model call time, request to finish (event times)",
            ("provider", "model"), LATENCY_BUCKETS)
        self.provider_errors = r.counter("provider_errors_total", "Failed model calls",
                                         ("provider", "model", "code"))
        self.tool_results = r.counter("tool_results_total", "Tool results", ("error",))
        self.sessions = r.gauge("sessions", "Sessions seen")
        self.turns_in_flight = r.gauge("turns_in_flight", "Sessions inside a turn")
        self.sse_clients = r.gauge("sse_clients", "Open Server-Sent Events streams")
        self.lag_records = r.gauge("consumer_lag_records", "Records behind the end",
                                   ("group", "topic", "partition"))
        self.lag_seconds = r.gauge("consumer_lag_seconds", "Age of the oldest unread record",
                                   ("group", "topic", "partition"))
        self.undecodable = r.counter("undecodable_records_total",
                                     "Records of the session topic that could not be decoded")
        self.feed_offset = r.gauge("feed_position", "Next offset the dashboard reads",
                                   ("partition",))


class FleetModel:
    """Rows and chart series folded from session events (see the module doc)."""

    def __init__(self) -> None:
        self.rows: dict[str, SessionRow] = {}
        self.changed: set[str] = set()
        self.metrics = DashboardMetrics()
        self.tokens = TimeBuckets(TOKEN_BUCKET_MS, history_ms=120_000)
        self.end_reasons = TimeBuckets(EVENT_BUCKET_MS)
        self.tool_results = TimeBuckets(EVENT_BUCKET_MS)
        self.step_latency = RecentSamples(LATENCY_SPAN_MS)
        self.turn_latency = RecentSamples(LATENCY_SPAN_MS)
        self.in_flight: list[list[int]] = []
        self.lag: list[dict[str, JsonValue]] = []

    def apply(self, session_id: str, event: Event, partition: int = -1) -> None:
        row = self.rows.get(session_id)
        if row is None:
            row = self.rows[session_id] = SessionRow(FleetStatus(session_id))
        row.partition = partition
        data = event.data if isinstance(event.data, Mapping) else {}
        self.metrics.events.inc(type=event.type)
        self._timing(row, event, data)
        sample = row.usage.apply(session_id, event)
        if sample is not None:
            self._tokens(event.time, sample.provider, sample.model,
                         sample.counts.input_tokens + sample.counts.cache_read_tokens
                         + sample.counts.cache_write_tokens, sample.counts.output_tokens)
        if event.type == "session/title" and isinstance(data.get("title"), str):
            row.title = str(data["title"])
        if row.status.apply(event) or sample is not None or event.type != "assistant/chunk":
            self.changed.add(session_id)

    def _tokens(self, time_ms: int, provider: str, model: str, tokens_in: int,
                tokens_out: int) -> None:
        key = f"{provider}/{model}"
        self.tokens.add(time_ms, key, tokens_in + tokens_out)
        self.metrics.tokens.inc(tokens_in, provider=provider, model=model, direction="input")
        self.metrics.tokens.inc(tokens_out, provider=provider, model=model, direction="output")

    def _timing(self, row: SessionRow, event: Event, data: Mapping[str, JsonValue]) -> None:
        kind, at = event.type, event.time
        if kind == "turn/start":
            row.turn_started_ms = at
        elif kind == "turn/end":
            self._turn_end(row, at, data)
        elif kind in ("step/start", "llm/retry-started"):
            row.attempt_started_ms = at
            if kind == "step/start":
                row.step_started_ms = at
        elif kind == "step/end":
            self.metrics.steps.inc()
            if row.step_started_ms is not None:
                self.step_latency.add(at, max(0, at - row.step_started_ms) / 1000)
                row.step_started_ms = None
        elif kind == "assistant/chunk":
            self._chunk(row, at, data)
        elif kind == "tool/result":
            failed = isinstance(data.get("error"), Mapping)
            self.tool_results.add(at, "error" if failed else "ok")
            self.metrics.tool_results.inc(error=str(failed).lower())

    def _turn_end(self, row: SessionRow, at: int, data: Mapping[str, JsonValue]) -> None:
        reason = data.get("reason")
        kind = reason.get("kind") if isinstance(reason, Mapping) else None
        label = kind if isinstance(kind, str) else "unknown"
        self.end_reasons.add(at, label)
        self.metrics.turns.inc(reason=label)
        if row.turn_started_ms is not None:
            self.turn_latency.add(at, max(0, at - row.turn_started_ms) / 1000)
            row.turn_started_ms = None

    def _chunk(self, row: SessionRow, at: int, data: Mapping[str, JsonValue]) -> None:
        chunk = data.get("chunk")
        if not isinstance(chunk, Mapping) or chunk.get("type") != "finish":
            return
        labels = row.model_labels()
        if row.attempt_started_ms is not None:
            seconds = max(0, at - row.attempt_started_ms) / 1000
            self.metrics.provider_latency.observe(seconds, **labels)
            row.attempt_started_ms = None
        reason = chunk.get("reason")
        if isinstance(reason, Mapping) and reason.get("kind") == "error":
            failure = reason.get("failure")
            code = failure.get("code") if isinstance(failure, Mapping) else None
            self.metrics.provider_errors.inc(1, code=str(code or "unknown"), **labels)

    def take_changed(self) -> list[dict[str, JsonValue]]:
        """The rows changed since the last call (for the live fleet stream)."""
        rows = [self.rows[s].to_json() for s in sorted(self.changed)]
        self.changed.clear()
        return rows

    def snapshot_rows(self) -> list[dict[str, JsonValue]]:
        return [row.to_json() for _, row in sorted(self.rows.items())]

    def tick(self, now_ms: int) -> None:
        """Sample the gauges (once a second): turns in flight, sessions."""
        in_turn = sum(1 for row in self.rows.values() if row.status.state == IN_TURN)
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

    def set_lag(self, samples: list[dict[str, JsonValue]]) -> None:
        self.lag = samples
        pairs = [({"group": str(s["group"]), "topic": str(s["topic"]),
                   "partition": str(s["partition"])}, s) for s in samples]
        self.metrics.lag_records.replace((labels, float(str(s["records"])))
                                         for labels, s in pairs)
        self.metrics.lag_seconds.replace((labels, float(str(s["seconds"])))
                                         for labels, s in pairs)


def _rate(sums: Mapping[str, float]) -> float | None:
    total = sums.get("ok", 0.0) + sums.get("error", 0.0)
    return None if total == 0 else sums.get("error", 0.0) / total
