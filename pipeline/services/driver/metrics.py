"""What the session runners record for ``/metrics``: provider calls, turns and steps.

Labelled series (latency by provider and model, errors by code, turns by end reason) live
in a :class:`~pipeline.core.metrics.MetricsRegistry` named ``dsh_driver_<name>``; the
driver's status server renders it after the plain counters of ``DriverMetrics``.
One :class:`RunnerMetrics` is shared by every runner of a driver (one event loop, no lock).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from pipeline.core.events import Event
from pipeline.core.metrics import MetricsRegistry

# provider calls stream a whole step: from a fast scripted echo to minutes of reasoning
PROVIDER_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                           120.0, 300.0)


class RunnerMetrics:
    """Provider latency and errors, turns and steps, recorded by ``SessionRunner``."""

    def __init__(self, registry: MetricsRegistry | None = None,
                 monotonic: Callable[[], float] = time.perf_counter) -> None:
        self.registry = registry if registry is not None else MetricsRegistry("dsh_driver_")
        self.monotonic = monotonic  # seconds, for durations only
        self.provider_seconds = self.registry.histogram(
            "provider_call_seconds", "Duration of one provider call (a whole streamed step), "
            "failed or not", ("provider", "model"), PROVIDER_BUCKETS)
        self.provider_errors = self.registry.counter(
            "provider_errors_total", "Provider calls that failed, by error code",
            ("provider", "model", "code"))
        self.turns = self.registry.counter(
            "turns_total", "Turns ended, by end reason kind", ("kind",))
        self.steps = self.registry.counter("steps_total", "Steps started")

    def provider_call(self, provider: str, model: str, seconds: float,
                      error_code: str | None = None) -> None:
        """One finished provider call; ``error_code`` when it failed (ProviderError.code)."""
        self.provider_seconds.observe(seconds, provider=provider, model=model)
        if error_code is not None:
            self.provider_errors.inc(provider=provider, model=model, code=error_code)

    def events(self, events: Sequence[Event]) -> None:
        """Count the turn ends (by ``reason.kind``) and step starts among appended events."""
        for event in events:
            if event.type == "step/start":
                self.steps.inc()
            elif event.type == "turn/end":
                self.turns.inc(kind=_end_kind(event))

    def render(self) -> str:
        return self.registry.render()


def _end_kind(turn_end: Event) -> str:
    data = turn_end.data
    reason = data.get("reason") if isinstance(data, Mapping) else None
    kind = reason.get("kind") if isinstance(reason, Mapping) else None
    return kind if isinstance(kind, str) else "unknown"
