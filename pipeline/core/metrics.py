"""A tiny metrics registry rendered in the Prometheus text exposition format (version 0.0.4).

Counters, gauges and histograms, each with a fixed tuple of label names::

    registry = MetricsRegistry(prefix="dsh_dashboard_")
    events = registry.counter("events_total", "Session events read", ("type",))
    events.inc(type="turn/end")
    latency = registry.histogram("step_seconds", "Step latency", buckets=(0.1, 1, 10))
    latency.observe(0.42)
    text = registry.render()

Pure and synchronous (no clock, no I/O): services own the registry and serve ``render()``.
Also :func:`percentile` and :class:`RecentSamples` for the percentiles a page draws.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from pipeline.core.errors import ConfigError

DEFAULT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                          30.0, 60.0, 300.0)
LabelKey = tuple[str, ...]


def _check_name(name: str) -> None:
    ok = bool(name) and (name[0].isalpha() or name[0] in "_:") and all(
        c.isalnum() or c in "_:" for c in name) and name.isascii()
    if not ok:
        raise ConfigError(f"metric or label name {name!r} is not [a-zA-Z_:][a-zA-Z0-9_:]*")


def escape_label(value: str) -> str:
    """A label value escaped for the text format (backslash, quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(value)


def _labels_text(names: Sequence[str], values: Sequence[str],
                 extra: tuple[str, str] | None = None) -> str:
    pairs = [f'{n}="{escape_label(v)}"' for n, v in zip(names, values, strict=True)]
    if extra is not None:
        pairs.append(f'{extra[0]}="{escape_label(extra[1])}"')
    return "{" + ",".join(pairs) + "}" if pairs else ""


@dataclass(slots=True)
class _Metric:
    name: str
    help: str
    label_names: tuple[str, ...]

    def key(self, labels: dict[str, str]) -> LabelKey:
        if set(labels) != set(self.label_names):
            raise ConfigError(f"metric {self.name}: labels {sorted(labels)} given, "
                              f"{list(self.label_names)} expected")
        return tuple(str(labels[n]) for n in self.label_names)

    def header(self, kind: str) -> list[str]:
        text = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {text}", f"# TYPE {self.name} {kind}"]


@dataclass(slots=True)
class Counter(_Metric):
    """A monotonically increasing value per label set (name should end in ``_total``)."""

    values: dict[LabelKey, float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ConfigError(f"counter {self.name} cannot decrease (inc by {amount})")
        key = self.key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self.key(labels), 0.0)

    def lines(self) -> list[str]:
        out = self.header("counter")
        for key, value in sorted(self.values.items()):
            out.append(f"{self.name}{_labels_text(self.label_names, key)} {format_value(value)}")
        return out


@dataclass(slots=True)
class Gauge(_Metric):
    """A value that goes up and down; ``replace`` swaps the whole label set at once."""

    values: dict[LabelKey, float] = field(default_factory=dict)

    def set(self, value: float, **labels: str) -> None:
        self.values[self.key(labels)] = float(value)

    def get(self, **labels: str) -> float:
        return self.values.get(self.key(labels), 0.0)

    def replace(self, samples: Iterable[tuple[dict[str, str], float]]) -> None:
        self.values = {self.key(labels): float(value) for labels, value in samples}

    def lines(self) -> list[str]:
        out = self.header("gauge")
        for key, value in sorted(self.values.items()):
            out.append(f"{self.name}{_labels_text(self.label_names, key)} {format_value(value)}")
        return out


@dataclass(slots=True)
class Histogram(_Metric):
    """Cumulative buckets, ``_sum`` and ``_count`` per label set."""

    buckets: tuple[float, ...] = DEFAULT_BUCKETS
    counts: dict[LabelKey, list[int]] = field(default_factory=dict)
    sums: dict[LabelKey, float] = field(default_factory=dict)

    def observe(self, value: float, **labels: str) -> None:
        key = self.key(labels)
        counts = self.counts.setdefault(key, [0] * (len(self.buckets) + 1))
        counts[bisect_left(self.buckets, value)] += 1
        self.sums[key] = self.sums.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        return sum(self.counts.get(self.key(labels), []))

    def lines(self) -> list[str]:
        out = self.header("histogram")
        names = self.label_names
        for key, counts in sorted(self.counts.items()):
            running = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                running += n
                # le as prometheus_client writes it ("1.0", "+Inf"): one series per bound
                le = "+Inf" if math.isinf(bound) else repr(float(bound))
                labels = _labels_text(names, key, ("le", le))
                out.append(f"{self.name}_bucket{labels} {running}")
            out.append(f"{self.name}_sum{_labels_text(names, key)} "
                       f"{format_value(self.sums[key])}")
            out.append(f"{self.name}_count{_labels_text(names, key)} {running}")
        return out


class MetricsRegistry:
    """Metrics under one name prefix, rendered together in registration order."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}

    def _name(self, name: str, labels: Sequence[str]) -> str:
        full = self.prefix + name
        for each in (full, *labels):
            _check_name(each)
        if full in self._metrics:
            raise ConfigError(f"metric {full} is registered twice")
        return full

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        metric = Counter(self._name(name, labels), help, tuple(labels))
        self._metrics[metric.name] = metric
        return metric

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        metric = Gauge(self._name(name, labels), help, tuple(labels))
        self._metrics[metric.name] = metric
        return metric

    def histogram(self, name: str, help: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_BUCKETS) -> Histogram:
        ordered = tuple(sorted(float(b) for b in buckets))
        if not ordered or len(set(ordered)) != len(ordered):
            raise ConfigError(f"histogram {name}: buckets must be distinct and non-empty")
        if "le" in labels:
            raise ConfigError(f"histogram {name}: 'le' is reserved")
        metric = Histogram(self._name(name, labels), help, tuple(labels), ordered)
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines += metric.lines()
        return "\n".join(lines) + "\n"


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
