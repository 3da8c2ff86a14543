"""Percentiles of the latencies the dashboard draws: nearest-rank :func:`percentile` over a
sliding span of recent samples (:class:`RecentSamples`; times given by the caller).

Pure and synchronous; the service's ``/metrics`` is ``prometheus_client``'s
(:class:`~pipeline.services.dashboard.model.DashboardMetrics`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by nearest rank of already sorted values; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass(slots=True)
class RecentSamples:
    """The samples observed within ``span_ms`` of the newest (times given by the caller)."""

    span_ms: int = 60_000
    limit: int = 5000
    _samples: deque[tuple[int, float]] = field(default_factory=deque)

    def add(self, time_ms: int, value: float) -> None:
        self._samples.append((time_ms, value))
        if len(self._samples) > self.limit:
            self._samples.popleft()

    def quantiles(self, now_ms: int, qs: Sequence[float] = (0.5, 0.95, 0.99)
                  ) -> list[float | None]:
        while self._samples and now_ms - self._samples[0][0] > self.span_ms:
            self._samples.popleft()
        values = sorted(v for _, v in self._samples)
        return [percentile(values, q) for q in qs]
