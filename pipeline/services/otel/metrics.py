"""What the otel service shows on ``/metrics``: the GenAI client histograms of the calls it
exported, and its own progress (``dsh_otel_*``)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pipeline.adapters.metrics.genai import GenAiClientMetrics
from pipeline.core.genai_trace import Span
from pipeline.core.usage import TokenCounts


class OtelMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.genai = GenAiClientMetrics(r)
        self.turns = Counter("dsh_otel_turns_exported", "Turns exported as traces", registry=r)
        self.spans = Counter("dsh_otel_spans_exported", "Spans acknowledged by the receiver",
                             registry=r)
        self.events = Counter("dsh_otel_events_read", "Session events read (span types only)",
                              registry=r)
        self.retries = Counter("dsh_otel_export_retries",
                               "Export attempts retried (429/502/503/504, receiver away)",
                               registry=r)
        self.dead_letters = Counter(
            "dsh_otel_dead_letters", "Turns or records dead-lettered (receiver refused with "
            "400, or undecodable)", registry=r)
        self.rejected = Counter("dsh_otel_spans_rejected",
                                "Spans a receiver accepted the request of but rejected",
                                registry=r)
        self.partial_turns = Counter(
            "dsh_otel_turns_partial", "Turns not exported: seen without their turn/start "
            "(a stream joined mid-turn) or without their turn/end", registry=r)
        self.open_turns = Gauge("dsh_otel_open_turns", "Turns begun and not yet ended",
                                registry=r)
        self.group_members = Gauge(
            "dsh_consumer_group_members", "Members of each of the project's consumer groups "
            "(ids starting with DSH_GROUP_ID_PREFIX), as the otel service last saw them",
            ("group",), registry=r)
        self.oldest_open_turn = Gauge(
            "dsh_otel_oldest_open_turn_seconds", "Age of the oldest turn begun and not yet "
            "ended (now minus its turn/start time), 0 when none is open", registry=r)

    def registry_text(self) -> str:
        return generate_latest(self.registry).decode("utf-8")

    def chat_spans(self, spans: Iterable[Span]) -> None:
        """The GenAI client histograms from exported ``chat`` spans."""
        for span in spans:
            if span.operation != "chat":
                continue
            a = span.attributes
            usage = None
            if "gen_ai.usage.input_tokens" in a:
                usage = TokenCounts(int(a["gen_ai.usage.input_tokens"]),  # type: ignore[arg-type]
                                    int(a["gen_ai.usage.output_tokens"]))  # type: ignore[arg-type]
            self.genai.call(str(a.get("gen_ai.provider.name")), str(a.get("gen_ai.request.model")),
                            (span.end_ms - span.start_ms) / 1000, usage=usage,
                            error_type=str(a.get("error.type", "")))
