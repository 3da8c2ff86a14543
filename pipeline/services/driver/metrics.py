"""What the session runners record for ``/metrics``: provider calls, turns and steps.

Labelled series (latency by provider and model, errors by code, turns by end reason) live
in a ``prometheus_client`` registry, named ``dsh_driver_<name>``, beside the GenAI client
histograms of the semantic conventions (``gen_ai_client_operation_duration_seconds`` per
provider call, ``gen_ai_client_token_usage`` per answered call, from its
``assistant/message`` usage); the driver's status server renders it after the plain
counters of ``DriverMetrics``. One :class:`RunnerMetrics` is shared by every runner of a
driver (one event loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pipeline.adapters.metrics.genai import GenAiClientMetrics
from pipeline.core.errors import EventError
from pipeline.core.events import Event
from pipeline.core.lifecycle import end_reason_kind
from pipeline.core.usage import UNKNOWN, TokenCounts, message_model

# provider calls stream a whole step: from a fast scripted echo to minutes of reasoning
PROVIDER_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                           120.0, 300.0)


class RunnerMetrics:
    """Provider latency and errors, turns and steps, recorded by ``SessionRunner``."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 monotonic: Callable[[], float] = time.perf_counter) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.monotonic = monotonic  # seconds, for durations only
        r = self.registry
        self.provider_seconds = Histogram(
            "dsh_driver_provider_call_seconds", "Duration of one provider call (a whole "
            "streamed step), failed or not", ("provider", "model"), buckets=PROVIDER_BUCKETS,
            registry=r)
        self.provider_errors = Counter(
            "dsh_driver_provider_errors", "Provider calls that failed, by error code",
            ("provider", "model", "code"), registry=r)
        self.turns = Counter("dsh_driver_turns", "Turns ended, by end reason kind", ("kind",),
                             registry=r)
        self.steps = Counter("dsh_driver_steps", "Steps started", registry=r)
        self.genai = GenAiClientMetrics(r)

    def provider_call(self, provider: str, model: str, seconds: float,
                      error_code: str | None = None) -> None:
        """One finished provider call; ``error_code`` when it failed (ProviderError.code)."""
        self.provider_seconds.labels(provider, model).observe(seconds)
        self.genai.call(provider, model, seconds, error_type=error_code or "")
        if error_code is not None:
            self.provider_errors.labels(provider, model, error_code).inc()

    def events(self, events: Sequence[Event]) -> None:
        """Count the turn ends (by ``reason.kind``) and step starts among appended events,
        and the tokens of every answered call (``assistant/message`` usage)."""
        for event in events:
            if event.type == "step/start":
                self.steps.inc()
            elif event.type == "turn/end":
                self.turns.labels(_end_kind(event)).inc()
            elif event.type == "assistant/message":
                self._tokens(event)

    def _tokens(self, message: Event) -> None:
        data = message.data
        usage = data.get("usage") if isinstance(data, Mapping) else None
        if usage is None:
            return
        try:
            counts = TokenCounts.from_dsh(usage, seq=message.seq)
        except EventError:
            return
        provider, model = message_model(message) or (UNKNOWN, UNKNOWN)
        tokens = counts.otel_attributes()
        for kind in ("input", "output"):
            self.genai.token_usage.labels("chat", provider, model, kind).observe(
                tokens[f"gen_ai.usage.{kind}_tokens"])

    def render(self) -> str:
        return generate_latest(self.registry).decode("utf-8")


def _end_kind(turn_end: Event) -> str:
    data = turn_end.data
    reason = data.get("reason") if isinstance(data, Mapping) else None
    kind = end_reason_kind(reason)
    return UNKNOWN if kind is None else kind
