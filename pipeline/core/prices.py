"""Prices and cost: the price table (``DSH_PRICES``) and the exact cost of token usage.

The table maps ``provider/model`` (or ``provider/*``, for every model of a provider without
a key of its own) to price entries, each valid from a moment on::

    {"deepseek/deepseek-chat": [
        {"from": "2025-09-05", "input": "0.28", "cached_input": "0.028", "output": "0.42"}],
     "openai/*": {"from": "2025-01-01T00:00:00Z", "input": 2.5, "output": 10}}

- Prices are per **million tokens**, in the one currency the table is written in, as
  decimal strings or JSON numbers read exactly (at most 9 decimal places; never negative).
  ``cached_input`` (cache reads) and ``cache_write`` (cache writes) default to ``input``.
- ``from`` is a date (``2025-09-05``, midnight UTC) or a date-time with an offset
  (``2025-09-05T16:30:00+08:00``). The entry that applies to a call is the one of the most
  specific key whose ``from`` is the latest at or before the call's event time; a call
  before every ``from`` of that key has no price.
- Change a price by adding an entry with a later ``from``, never by editing a past one:
  the ledger stays replay-identical only while the table says the same about the past.

**Units and rounding.** A price is held as an integer of nano-units (1e-9 of the currency)
per million tokens, so ``tokens * price`` is an exact integer of *femto-units* (1e-15 of
the currency): a call's cost, and every sum of calls, is exact, with no rounding at all.
Rounding happens once, when a sum is shown: :attr:`Cost.nanos` is the exact sum in
nano-units rounded half up. (The rounded sums of several rows may therefore differ from the
rounded sum of their total by less than half a nano-unit per row.)

dsh's counts are disjoint (:mod:`pipeline.core.usage`): ``inputTokens`` (plain input) is
priced at ``input``, ``cacheReadTokens`` at ``cached_input``, ``cacheWriteTokens`` at
``cache_write``, ``outputTokens`` (reasoning included) at ``output``.

**No price is not zero.** A call without a price adds nothing to ``femto`` but counts in
``unpriced_calls`` and ``unpriced_tokens``; a sum with no priced call has no cost
(:attr:`Cost.nanos` is None), and one with some unpriced calls is a partial cost.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal, InvalidOperation
from typing import Final

from pipeline.core.errors import ConfigError
from pipeline.core.events import JsonValue
from pipeline.core.usage import TokenCounts

NANOS: Final = 10**9            # nano-units in one unit of currency
FEMTO_PER_NANO: Final = 10**6   # femto-units in one nano-unit
SETTING: Final = "DSH_PRICES"
PRICE_FIELDS: Final = ("input", "cached_input", "cache_write", "output")
EXAMPLE: Final = ('{"deepseek/deepseek-chat": [{"from": "2025-09-05", "input": "0.28", '
                  '"cached_input": "0.028", "output": "0.42"}]}')


@dataclass(frozen=True, slots=True)
class Price:
    """One entry: nano-units per million tokens of each kind, valid from ``from_ms`` on."""

    from_ms: int
    input: int
    cached_input: int
    cache_write: int
    output: int

    def femto(self, counts: TokenCounts) -> int:
        """The exact cost of ``counts`` in femto-units."""
        return (counts.input_tokens * self.input
                + counts.cache_read_tokens * self.cached_input
                + counts.cache_write_tokens * self.cache_write
                + counts.output_tokens * self.output)


def tokens_of(counts: TokenCounts) -> int:
    """Every token a provider bills: input, cache reads, cache writes and output."""
    return (counts.input_tokens + counts.cache_read_tokens + counts.cache_write_tokens
            + counts.output_tokens)


@dataclass(frozen=True, slots=True)
class Cost:
    """A sum of calls' costs: exact femto-units of the priced calls, and the unpriced ones."""

    femto: int = 0
    priced_calls: int = 0
    unpriced_calls: int = 0
    unpriced_tokens: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.femto + other.femto, self.priced_calls + other.priced_calls,
                    self.unpriced_calls + other.unpriced_calls,
                    self.unpriced_tokens + other.unpriced_tokens)

    @property
    def nanos(self) -> int | None:
        """The cost in nano-units, rounded half up; None when no call had a price."""
        if self.priced_calls == 0:
            return None
        return (self.femto + FEMTO_PER_NANO // 2) // FEMTO_PER_NANO

    def to_json(self) -> dict[str, int]:
        """The form kept in tables (exact: femto-units)."""
        return {"femto": self.femto, "priced": self.priced_calls,
                "unpricedCalls": self.unpriced_calls, "unpricedTokens": self.unpriced_tokens}

    @classmethod
    def from_json(cls, raw: Mapping[str, JsonValue] | None) -> Cost:
        raw = raw or {}
        return cls(*(_int(raw.get(name)) for name in
                     ("femto", "priced", "unpricedCalls", "unpricedTokens")))

    def record_fields(self) -> dict[str, JsonValue]:
        """The cost keys of an exported usage record (``dsh.cost.nanos`` absent when no
        call had a price)."""
        fields: dict[str, JsonValue] = {} if self.nanos is None else {
            "dsh.cost.nanos": self.nanos}
        fields["dsh.cost.unpriced_calls"] = self.unpriced_calls
        fields["dsh.cost.unpriced_tokens"] = self.unpriced_tokens
        return fields


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def format_nanos(nanos: int) -> str:
    """Nano-units as a decimal amount with all 9 places (``1234567`` -> ``0.001234567``)."""
    sign = "-" if nanos < 0 else ""
    whole, frac = divmod(abs(nanos), NANOS)
    return f"{sign}{whole}.{frac:09d}"


@dataclass(frozen=True, slots=True)
class PriceTable:
    """Price entries by key (``provider/model`` or ``provider/*``), each sorted by ``from``."""

    entries: Mapping[str, tuple[Price, ...]] = field(default_factory=dict)

    def key_for(self, provider: str, model: str) -> str | None:
        """The most specific key of the table that holds for the model, if any."""
        for key in (f"{provider}/{model}", f"{provider}/*"):
            if key in self.entries:
                return key
        return None

    def price_at(self, provider: str, model: str, time_ms: int) -> Price | None:
        """The entry that applies to a call at event time ``time_ms`` (None: no price)."""
        key = self.key_for(provider, model)
        if key is None:
            return None
        prices = self.entries[key]
        index = bisect.bisect_right([p.from_ms for p in prices], time_ms)
        return prices[index - 1] if index else None

    def cost(self, provider: str, model: str, time_ms: int, counts: TokenCounts) -> Cost:
        """The cost of one call (or of several calls at the same moment)."""
        price = self.price_at(provider, model, time_ms)
        if price is None:
            return Cost(unpriced_calls=counts.calls, unpriced_tokens=tokens_of(counts))
        return Cost(price.femto(counts), priced_calls=counts.calls)


def parse_prices(raw: object) -> PriceTable:
    """The table of a decoded ``DSH_PRICES`` JSON object (numbers best decoded as Decimal:
    ``json.loads(text, parse_float=Decimal)``); ConfigError naming what is wrong."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{SETTING} must be a JSON object, e.g. {EXAMPLE}")
    entries: dict[str, tuple[Price, ...]] = {}
    for key, value in raw.items():
        provider, slash, model = str(key).partition("/")
        if not slash or not provider or not model or "/" in model:
            raise ConfigError(f"{SETTING} key {key!r} must be provider/model or provider/*")
        items = value if isinstance(value, list) else [value]
        prices = sorted((_entry(key, i, item) for i, item in enumerate(items)),
                        key=lambda p: p.from_ms)
        if not prices:
            raise ConfigError(f"{SETTING}[{key!r}] holds no price entry")
        starts = [p.from_ms for p in prices]
        if len(set(starts)) != len(starts):
            raise ConfigError(f"{SETTING}[{key!r}] has two entries with the same 'from'")
        entries[key] = tuple(prices)
    return PriceTable(entries)


def _entry(key: str, index: int, item: object) -> Price:
    where = f"{SETTING}[{key!r}][{index}]"
    if not isinstance(item, Mapping):
        raise ConfigError(f"{where} must be an object like {{\"from\": \"2025-01-01\", "
                          f"\"input\": \"0.28\", \"output\": \"0.42\"}}")
    unknown = set(item) - {"from", *PRICE_FIELDS}
    if unknown:
        raise ConfigError(f"{where} has unknown keys {sorted(unknown)}: use from, "
                          f"{', '.join(PRICE_FIELDS)}")
    for required in ("from", "input", "output"):
        if required not in item:
            raise ConfigError(f"{where} lacks {required!r}")
    input_price = nanos_per_million(item["input"], f"{where}.input")
    return Price(from_ms=epoch_ms(item["from"], f"{where}.from"), input=input_price,
                 cached_input=_optional(item, "cached_input", input_price, where),
                 cache_write=_optional(item, "cache_write", input_price, where),
                 output=nanos_per_million(item["output"], f"{where}.output"))


def _optional(item: Mapping[str, object], name: str, default: int, where: str) -> int:
    return nanos_per_million(item[name], f"{where}.{name}") if name in item else default


def nanos_per_million(value: object, where: str) -> int:
    """A price per million tokens (decimal string, int or Decimal) in nano-units, exactly."""
    if isinstance(value, bool) or not isinstance(value, str | int | Decimal):
        hint = " (a float is not exact: write it as a string)" if isinstance(value, float) else ""
        raise ConfigError(f"{where} must be a decimal price like \"0.28\", got "
                          f"{value!r}{hint}")
    try:
        amount = Decimal(value.strip() if isinstance(value, str) else value)
    except InvalidOperation:
        raise ConfigError(f"{where} must be a decimal price like \"0.28\", got "
                          f"{value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise ConfigError(f"{where} must be a finite price >= 0, got {value!r}")
    scaled = amount * NANOS
    if scaled != scaled.to_integral_value():
        raise ConfigError(f"{where} has more than 9 decimal places: {value!r}")
    return int(scaled)


def epoch_ms(value: object, where: str) -> int:
    """``from``: an ISO date (midnight UTC) or date-time with an offset, in epoch ms."""
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be an ISO date or date-time, got {value!r}")
    text = value.strip()
    try:
        if len(text) == 10:
            moment = datetime.combine(date.fromisoformat(text), datetime.min.time(), UTC)
        else:
            moment = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{where} is not an ISO date (2025-09-05) or date-time "
                          f"(2025-09-05T16:30:00Z): {value!r}") from None
    if moment.tzinfo is None:
        raise ConfigError(f"{where} needs an offset (e.g. Z or +08:00): {value!r}")
    delta = moment - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def prices_from_text(text: str) -> PriceTable:
    """The table of ``DSH_PRICES`` JSON text; numbers are read exactly (as decimals)."""
    try:
        decoded = json.loads(text, parse_float=Decimal)
    except ValueError as exc:
        raise ConfigError(f"{SETTING} is not JSON: {exc}") from None
    return parse_prices(decoded)
