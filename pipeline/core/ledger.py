"""The cost ledger: token usage and cost per tenant, provider/model and hour.

One ledger row sums the calls of one tenant's sessions to one provider/model whose event
``time`` lies in one hour (UTC, ``[start, start + 1 h)``). Rows never close: a call that
comes late still lands in its hour, so the ledger equals the sum over the log exactly,
however the calls were delivered. Its cost is exact (:mod:`pipeline.core.prices`: femto-units
kept, nano-units shown); calls without a price are counted apart, never as zero.

On the usage topic a row is a ``dsh.UsageRecord`` of kind ``tenant`` keyed
``tenant/<tenant>/hour/<start ms>/<provider>/<model>`` (the default tenant ``""`` gives
``tenant//hour/...``; a tenant name has no ``/``, a model name may). :class:`Ledger` is the
reference: the ledger computed directly from session logs, which every published ledger
must equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from pipeline.core.events import Event, JsonValue
from pipeline.core.prices import Cost, PriceTable
from pipeline.core.usage import SessionUsage, TokenCounts, UsageSample, window_start

HOUR_MS: Final = 3_600_000
KIND: Final = "tenant"
TENANT_FIELD: Final = "dsh.tenant"


@dataclass(frozen=True, slots=True)
class RowId:
    """Which row a call belongs to."""

    tenant: str
    start_ms: int
    provider: str
    model: str

    @property
    def key(self) -> str:
        return ledger_key(self.tenant, self.start_ms, self.provider, self.model)

    @classmethod
    def of(cls, sample: UsageSample) -> RowId:
        return cls(sample.tenant, window_start(sample.time, HOUR_MS), sample.provider,
                   sample.model)


def ledger_key(tenant: str, start_ms: int, provider: str, model: str) -> str:
    return f"{KIND}/{tenant}/hour/{start_ms}/{provider}/{model}"


def ledger_record(row: RowId, counts: TokenCounts, cost: Cost) -> dict[str, JsonValue]:
    """The exported ``dsh.UsageRecord`` of one row."""
    return {"kind": KIND, "granularity": "hour", "startMs": row.start_ms,
            "endMs": row.start_ms + HOUR_MS, "gen_ai.provider.name": row.provider,
            "gen_ai.request.model": row.model, **counts.otel_attributes(),
            TENANT_FIELD: row.tenant, **cost.record_fields()}


@dataclass(frozen=True, slots=True)
class LedgerLine:
    """A ledger row as a reader finds it on the usage topic (cost in nano-units)."""

    tenant: str
    start_ms: int
    provider: str
    model: str
    input_tokens: int
    cached_input_tokens: int
    cache_write_tokens: int
    output_tokens: int
    calls: int
    cost_nanos: int | None
    unpriced_calls: int
    unpriced_tokens: int

    @classmethod
    def from_record(cls, value: Mapping[str, JsonValue]) -> LedgerLine:
        """The line of a decoded ``tenant`` record; ValueError when it is not one."""
        if value.get("kind") != KIND:
            raise ValueError(f"not a {KIND} usage record: kind {value.get('kind')!r}")
        cost = value.get("dsh.cost.nanos")
        return cls(_text(value, TENANT_FIELD), _number(value, "startMs"),
                   _text(value, "gen_ai.provider.name"), _text(value, "gen_ai.request.model"),
                   _number(value, "dsh.usage.input_tokens"),
                   _number(value, "dsh.usage.cache_read_tokens"),
                   _number(value, "dsh.usage.cache_write_tokens"),
                   _number(value, "dsh.usage.output_tokens"), _number(value, "dsh.usage.calls"),
                   None if cost is None else _number(value, "dsh.cost.nanos"),
                   _number(value, "dsh.cost.unpriced_calls", 0),
                   _number(value, "dsh.cost.unpriced_tokens", 0))

    @property
    def model_key(self) -> str:
        return f"{self.provider}/{self.model}"

    def to_json(self) -> dict[str, JsonValue]:
        return {"tenant": self.tenant, "provider": self.provider, "model": self.model,
                "hourStartMs": self.start_ms, "inputTokens": self.input_tokens,
                "cachedInputTokens": self.cached_input_tokens,
                "cacheWriteTokens": self.cache_write_tokens,
                "outputTokens": self.output_tokens, "calls": self.calls,
                "costNanos": self.cost_nanos, "unpricedCalls": self.unpriced_calls,
                "unpricedTokens": self.unpriced_tokens}


def _text(value: Mapping[str, JsonValue], key: str) -> str:
    item = value.get(key)
    if not isinstance(item, str):
        raise ValueError(f"usage record lacks the string {key!r}")
    return item


def _number(value: Mapping[str, JsonValue], key: str, default: int | None = None) -> int:
    item = value.get(key, default)
    if not isinstance(item, int) or isinstance(item, bool):
        raise ValueError(f"usage record lacks the integer {key!r}")
    return item


@dataclass(slots=True)
class Ledger:
    """The ledger computed directly from session logs (or samples): the reference."""

    prices: PriceTable
    rows: dict[RowId, tuple[TokenCounts, Cost]] = field(default_factory=dict)

    def add(self, sample: UsageSample) -> RowId:
        row = RowId.of(sample)
        counts, cost = self.rows.get(row, (TokenCounts(), Cost()))
        self.rows[row] = (counts + sample.counts,
                          cost + self.prices.cost(sample.provider, sample.model, sample.time,
                                                  sample.counts))
        return row

    def add_log(self, session_id: str, events: Iterable[Event]) -> None:
        state = SessionUsage()
        for event in events:
            sample = state.apply(session_id, event)
            if sample is not None:
                self.add(sample)

    def records(self) -> dict[str, dict[str, JsonValue]]:
        """Every row's record by key: what the usage topic must hold."""
        return {row.key: ledger_record(row, counts, cost)
                for row, (counts, cost) in self.rows.items()}
