"""Token usage: samples from the log, totals, tumbling windows, OpenTelemetry GenAI export.

Usage is read only from ``assistant/message`` events (``data.usage``); the ``usage`` chunk of
the same call carries the same numbers and is not counted again. The provider and model come
from the message's ``source`` (``kind: "model"``) or else from the last ``request/header``
config of the session; when neither is known they are ``"unknown"``.

dsh counts are disjoint: ``inputTokens`` excludes cached input (``cacheReadTokens`` and
``cacheWriteTokens`` are separate) and ``reasoningTokens`` is part of ``outputTokens``.
OpenTelemetry's ``gen_ai.usage.input_tokens`` INCLUDES cached input, so the export converts::

    gen_ai.usage.input_tokens                 = inputTokens + cacheReadTokens + cacheWriteTokens
    gen_ai.usage.output_tokens                = outputTokens
    gen_ai.usage.cache_read.input_tokens      = cacheReadTokens
    gen_ai.usage.cache_creation.input_tokens  = cacheWriteTokens

and keeps dsh's own disjoint counts beside them under ``dsh.usage.*``.

Windows are tumbling, keyed by event ``time`` (epoch ms), one minute and one hour long. Closing
is decided by a *tick* carrying a wall-clock time (the caller reads the clock, not this module):
a window closes once ``tick >= end + grace``; a sample for a window that is already closed is
late: it is still in the session and model totals (totals equal a full scan), but not in the
window, and the caller reports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from pipeline.core.errors import EventError
from pipeline.core.events import Event, JsonValue
from pipeline.core.tenants import DEFAULT_TENANT, TENANT_TYPE, folded_tenant

UNKNOWN: Final = "unknown"
WINDOW_SIZES_MS: Final = {"minute": 60_000, "hour": 3_600_000}
_DSH_FIELDS: Final = ("inputTokens", "outputTokens", "cacheReadTokens", "cacheWriteTokens",
                      "reasoningTokens")


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """dsh's disjoint counts summed over ``calls`` model calls."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0
    calls: int = 0

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(*(a + b for a, b in zip(self._tuple(), other._tuple(), strict=True)))

    def _tuple(self) -> tuple[int, ...]:
        return (self.input_tokens, self.output_tokens, self.cache_read_tokens,
                self.cache_write_tokens, self.reasoning_tokens, self.calls)

    @classmethod
    def from_dsh(cls, raw: JsonValue, *, seq: int | None = None) -> TokenCounts:
        """One call's usage object ``{inputTokens, outputTokens, cacheReadTokens?, ...}``."""
        if not isinstance(raw, Mapping):
            raise EventError("usage must be an object", seq=seq, type="assistant/message",
                             rule="usage-shape")
        values = []
        for name in _DSH_FIELDS:
            value = raw.get(name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise EventError(f"usage.{name} must be a non-negative integer, got {value!r}",
                                 seq=seq, type="assistant/message", rule="usage-shape")
            values.append(value)
        return cls(values[0], values[1], values[2], values[3], values[4], calls=1)

    def to_json(self) -> dict[str, int]:
        """dsh names (plus ``calls``): the form stored in tables and kept in exports."""
        return dict(zip((*_DSH_FIELDS, "calls"), self._tuple(), strict=True))

    @classmethod
    def from_json(cls, raw: Mapping[str, int]) -> TokenCounts:
        return cls(*(int(raw.get(name, 0)) for name in (*_DSH_FIELDS, "calls")))

    def otel_attributes(self) -> dict[str, int]:
        """OpenTelemetry GenAI usage attributes (input includes cached input) beside dsh's."""
        return {
            "gen_ai.usage.input_tokens":
                self.input_tokens + self.cache_read_tokens + self.cache_write_tokens,
            "gen_ai.usage.output_tokens": self.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": self.cache_read_tokens,
            "gen_ai.usage.cache_creation.input_tokens": self.cache_write_tokens,
            "dsh.usage.input_tokens": self.input_tokens,
            "dsh.usage.output_tokens": self.output_tokens,
            "dsh.usage.cache_read_tokens": self.cache_read_tokens,
            "dsh.usage.cache_write_tokens": self.cache_write_tokens,
            "dsh.usage.reasoning_tokens": self.reasoning_tokens,
            "dsh.usage.calls": self.calls,
        }


@dataclass(frozen=True, slots=True)
class UsageSample:
    """The usage of one ``assistant/message``: what the aggregates add up."""

    session_id: str
    seq: int
    time: int
    provider: str
    model: str
    counts: TokenCounts
    tenant: str = DEFAULT_TENANT

    @property
    def model_key(self) -> str:
        return model_key(self.provider, self.model)

    def to_json(self) -> dict[str, JsonValue]:
        """The JSON form; ``tenant`` only outside the default tenant (a sample written
        before samples carried a tenant reads as the default tenant's)."""
        raw: dict[str, JsonValue] = {
            "session": self.session_id, "seq": self.seq, "time": self.time,
            "provider": self.provider, "model": self.model, "usage": self.counts.to_json()}
        if self.tenant != DEFAULT_TENANT:
            raw["tenant"] = self.tenant
        return raw

    @classmethod
    def from_json(cls, raw: Mapping[str, JsonValue]) -> UsageSample:
        return cls(str(raw["session"]), int(raw["seq"]), int(raw["time"]), str(raw["provider"]),
                   str(raw["model"]), TokenCounts.from_json(raw["usage"]),
                   str(raw.get("tenant") or DEFAULT_TENANT))


def model_key(provider: str, model: str) -> str:
    return f"{provider}/{model}"


def header_model(event: Event) -> tuple[str, str] | None:
    """``(provider, model)`` from a ``request/header`` event's config, if it names them."""
    if event.type != "request/header" or not isinstance(event.data, Mapping):
        return None
    header = event.data.get("header")
    config = header.get("config") if isinstance(header, Mapping) else None
    if not isinstance(config, Mapping):
        return None
    provider, model = config.get("provider"), config.get("model")
    if isinstance(provider, str) and isinstance(model, str):
        return provider, model
    return None


def message_model(event: Event) -> tuple[str, str] | None:
    """``(provider, model)`` from an ``assistant/message``'s ``message.source``, if a model's."""
    message = event.data.get("message") if isinstance(event.data, Mapping) else None
    source = message.get("source") if isinstance(message, Mapping) else None
    if not isinstance(source, Mapping) or source.get("kind") != "model":
        return None
    provider, model = source.get("provider"), source.get("model")
    if isinstance(provider, str) and isinstance(model, str):
        return provider, model
    return None


@dataclass(slots=True)
class SessionUsage:
    """Per-session usage state: the totals, the model of the last request header and the
    session's tenant (:mod:`pipeline.core.tenants`: the first valid tenant event wins; the
    default tenant until one comes)."""

    totals: TokenCounts = field(default_factory=TokenCounts)
    last_model: tuple[str, str] | None = None
    tenant: str = DEFAULT_TENANT

    def apply(self, session_id: str, event: Event) -> UsageSample | None:
        """Fold one event; returns the sample it contributes, if any."""
        if event.type == TENANT_TYPE:
            self.tenant = folded_tenant(self.tenant, event.data)
            return None
        from_header = header_model(event)
        if from_header is not None:
            self.last_model = from_header
            return None
        if event.type != "assistant/message" or not isinstance(event.data, Mapping):
            return None
        raw = event.data.get("usage")
        if raw is None:
            return None
        counts = TokenCounts.from_dsh(raw, seq=event.seq)
        provider, model = message_model(event) or self.last_model or (UNKNOWN, UNKNOWN)
        self.totals = self.totals + counts
        return UsageSample(session_id, event.seq, event.time, provider, model, counts,
                           self.tenant)

    def to_json(self) -> dict[str, JsonValue]:
        raw: dict[str, JsonValue] = {
            "totals": self.totals.to_json(),
            "lastModel": list(self.last_model) if self.last_model else None}
        if self.tenant != DEFAULT_TENANT:
            raw["tenant"] = self.tenant
        return raw

    @classmethod
    def from_json(cls, raw: JsonValue) -> SessionUsage:
        if raw is None:
            return cls()
        last = raw.get("lastModel")
        return cls(TokenCounts.from_json(raw["totals"]), (last[0], last[1]) if last else None,
                   str(raw.get("tenant") or DEFAULT_TENANT))


def window_start(time_ms: int, size_ms: int) -> int:
    return time_ms - time_ms % size_ms


def window_key(granularity: str, start_ms: int, key_of_model: str) -> str:
    return f"window/{granularity}/{start_ms}/{key_of_model}"


@dataclass(slots=True)
class WindowBook:
    """The open windows of one partition of the per-model stream, and its last tick.

    ``sizes`` maps a granularity name to its length in ms (default: minute and hour).
    ``open`` maps a window key to ``[granularity, start_ms, end_ms, provider, model]``; the
    counts of a window live with the caller (one table entry per window), so a tick costs
    O(open windows).
    """

    grace_ms: int
    sizes: Mapping[str, int] = field(default_factory=lambda: dict(WINDOW_SIZES_MS))
    last_tick_ms: int = -1
    open: dict[str, list[JsonValue]] = field(default_factory=dict)

    def windows_for(self, sample: UsageSample) -> tuple[list[str], list[str]]:
        """The window keys the sample belongs to: (accepted, late). Opens new windows."""
        accepted: list[str] = []
        late: list[str] = []
        for granularity, size in self.sizes.items():
            start = window_start(sample.time, size)
            key = window_key(granularity, start, sample.model_key)
            if self.last_tick_ms >= start + size + self.grace_ms:
                late.append(key)
                continue
            self.open.setdefault(key, [granularity, start, start + size, sample.provider,
                                       sample.model])
            accepted.append(key)
        return accepted, late

    def tick(self, now_ms: int) -> list[tuple[str, list[JsonValue]]]:
        """Advance the clock (never backwards); returns the windows it closes."""
        self.last_tick_ms = max(self.last_tick_ms, now_ms)
        due = [(key, info) for key, info in self.open.items()
               if self.last_tick_ms >= int(info[2]) + self.grace_ms]
        for key, _info in due:
            del self.open[key]
        return due

    def to_json(self) -> dict[str, JsonValue]:
        return {"lastTickMs": self.last_tick_ms, "open": self.open}

    @classmethod
    def from_json(cls, raw: JsonValue, grace_ms: int, sizes: Mapping[str, int]) -> WindowBook:
        if raw is None:
            return cls(grace_ms, sizes)
        return cls(grace_ms, sizes, int(raw["lastTickMs"]), dict(raw["open"]))


def window_record(info: list[JsonValue], counts: TokenCounts, *, closed: bool
                  ) -> dict[str, JsonValue]:
    """The exported record of one window (``info`` as in :attr:`WindowBook.open`)."""
    granularity, start, end, provider, model = info
    return {"kind": "window", "granularity": granularity, "startMs": start, "endMs": end,
            "closed": closed, "gen_ai.provider.name": provider, "gen_ai.request.model": model,
            **counts.otel_attributes()}


def model_record(provider: str, model: str, counts: TokenCounts,
                 cost: Mapping[str, JsonValue] | None = None) -> dict[str, JsonValue]:
    """A model's totals; ``cost``: its cost keys (``Cost.record_fields`` of
    :mod:`pipeline.core.prices`), when priced."""
    return {"kind": "model", "gen_ai.provider.name": provider, "gen_ai.request.model": model,
            **counts.otel_attributes(), **(cost or {})}


def session_record(session_id: str, counts: TokenCounts) -> dict[str, JsonValue]:
    return {"kind": "session", "gen_ai.conversation.id": session_id, **counts.otel_attributes()}


@dataclass(slots=True)
class UsageScan:
    """A full scan of logs: the reference every aggregate must equal exactly."""

    by_session: dict[str, TokenCounts] = field(default_factory=dict)
    by_model: dict[str, TokenCounts] = field(default_factory=dict)

    def add_log(self, session_id: str, events: Iterable[Event]) -> None:
        state = SessionUsage()
        for event in events:
            sample = state.apply(session_id, event)
            if sample is not None:
                self.by_model[sample.model_key] = (
                    self.by_model.get(sample.model_key, TokenCounts()) + sample.counts)
        self.by_session[session_id] = state.totals
