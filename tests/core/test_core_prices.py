"""The price table (``DSH_PRICES``), exact cost, and the ledger computed from logs."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from pipeline.core.errors import ConfigError
from pipeline.core.events import Event
from pipeline.core.ledger import HOUR_MS, Ledger, LedgerLine, RowId, ledger_key, ledger_record
from pipeline.core.prices import (
    Cost,
    PriceTable,
    format_nanos,
    parse_prices,
    prices_from_text,
)
from pipeline.core.tenants import TENANT_TYPE
from pipeline.core.usage import TokenCounts, UsageSample

SEP_5_2025 = 1_757_030_400_000   # 2025-09-05T00:00:00Z

TABLE = prices_from_text("""{
  "deepseek/deepseek-chat": [
    {"from": "2025-09-05", "input": "0.28", "cached_input": "0.028", "output": "0.42"},
    {"from": "2024-01-01", "input": 0.27, "cached_input": 0.07, "output": 1.10}],
  "deepseek/*": {"from": "2024-01-01", "input": "1", "output": "2"},
  "anthropic/claude": {"from": "2025-01-01T00:00:00+08:00", "input": "3", "cached_input": "0.3",
                       "cache_write": "3.75", "output": "15"}
}""")


def test_the_entry_valid_at_the_event_time_applies() -> None:
    before, after = SEP_5_2025 - 1, SEP_5_2025
    assert TABLE.price_at("deepseek", "deepseek-chat", before).input == 270_000_000
    assert TABLE.price_at("deepseek", "deepseek-chat", after).input == 280_000_000
    assert TABLE.price_at("deepseek", "deepseek-chat", after).cached_input == 28_000_000
    # a date is midnight UTC; before the first entry of the most specific key: no price
    assert TABLE.price_at("deepseek", "deepseek-chat", 1_704_067_200_000 - 1) is None
    assert TABLE.price_at("deepseek", "deepseek-reasoner", 1_704_067_200_000).output == \
        2_000_000_000   # provider/* holds for a model without its own key
    assert TABLE.price_at("openai", "gpt", SEP_5_2025) is None


def test_an_offset_moves_the_start() -> None:
    start = 1_735_660_800_000   # 2025-01-01T00:00:00+08:00 = 2024-12-31T16:00:00Z
    assert TABLE.price_at("anthropic", "claude", start - 1) is None
    assert TABLE.price_at("anthropic", "claude", start) is not None


def test_disjoint_counts_are_priced_each_at_its_own_price_exactly() -> None:
    counts = TokenCounts(input_tokens=1_000, output_tokens=500, cache_read_tokens=10_000,
                         cache_write_tokens=2_000, reasoning_tokens=300, calls=1)
    cost = TABLE.cost("anthropic", "claude", SEP_5_2025, counts)
    # femto = tokens * nano-units per million: 1000*3 + 10000*0.3 + 2000*3.75 + 500*15 ($/M)
    assert cost.femto == (1_000 * 3 + 10_000 * Decimal("0.3") + 2_000 * Decimal("3.75")
                          + 500 * 15) * 10**9
    assert cost.nanos == 21_000_000   # $0.021: reasoning is inside output, not added
    assert format_nanos(cost.nanos) == "0.021000000"
    # cache writes cost the input price when the entry does not say
    deepseek = TABLE.cost("deepseek", "deepseek-chat", SEP_5_2025,
                          TokenCounts(0, 0, 0, 1_000_000, 0, 1))
    assert deepseek.nanos == 280_000_000


def test_sums_are_exact_and_rounded_once_half_up() -> None:
    one = TABLE.cost("deepseek", "deepseek-chat", SEP_5_2025, TokenCounts(1, 0, 0, 0, 0, 1))
    assert one.femto == 280_000_000 and one.nanos == 280   # 0.28 nano-units per token
    tiny = prices_from_text('{"p/m": {"from": "2020-01-01", "input": "0.0005", '
                            '"output": "0"}}')
    call = tiny.cost("p", "m", SEP_5_2025, TokenCounts(1, 0, 0, 0, 0, 1))
    assert call.femto == 500_000 and call.nanos == 1        # 0.5 nano rounds half up
    total = Cost()
    for _ in range(3):
        total = total + call
    assert total.femto == 1_500_000 and total.nanos == 2    # not 3 rounded calls
    assert (Cost(499_999, 1)).nanos == 0


def test_no_price_is_counted_apart_never_zero() -> None:
    counts = TokenCounts(100, 20, 30, 0, 0, 2)
    cost = TABLE.cost("openai", "gpt", SEP_5_2025, counts)
    assert cost == Cost(0, 0, unpriced_calls=2, unpriced_tokens=150)
    assert cost.nanos is None
    assert "dsh.cost.nanos" not in cost.record_fields()
    assert cost.record_fields() == {"dsh.cost.unpriced_calls": 2,
                                    "dsh.cost.unpriced_tokens": 150}
    assert PriceTable().cost("any", "model", 0, counts).nanos is None
    mixed = cost + TABLE.cost("deepseek", "x", SEP_5_2025, TokenCounts(1_000_000, 0, 0, 0, 0, 1))
    assert mixed.nanos == 1_000_000_000 and mixed.unpriced_calls == 2   # a partial cost


def test_cost_round_trips_through_its_table_form() -> None:
    cost = Cost(10**22, 5, 1, 9)   # beyond 64 bits: kept exact
    assert Cost.from_json(cost.to_json()) == cost
    assert Cost.from_json(None) == Cost()


@pytest.mark.parametrize(("raw", "match"), [
    ("[]", "must be a JSON object"),
    ('{"deepseek": {"from": "2025-01-01", "input": "1", "output": "1"}}',
     "must be provider/model or provider/\\*"),
    ('{"*": {"from": "2025-01-01", "input": "1", "output": "1"}}', "provider/model"),
    ('{"p/m": []}', "holds no price entry"),
    ('{"p/m": {"input": "1", "output": "1"}}', "lacks 'from'"),
    ('{"p/m": {"from": "2025-01-01", "output": "1"}}', "lacks 'input'"),
    ('{"p/m": {"from": "2025-01-01", "input": "1", "output": "1", "cached": "1"}}',
     "unknown keys \\['cached'\\]"),
    ('{"p/m": {"from": "2025-01-01", "input": "-1", "output": "1"}}', ">= 0"),
    ('{"p/m": {"from": "2025-01-01", "input": "abc", "output": "1"}}', "decimal price"),
    ('{"p/m": {"from": "2025-01-01", "input": "NaN", "output": "1"}}', "finite"),
    ('{"p/m": {"from": "2025-01-01", "input": true, "output": "1"}}', "decimal price"),
    ('{"p/m": {"from": "2025-01-01", "input": "0.0000000001", "output": "1"}}',
     "more than 9 decimal places"),
    ('{"p/m": {"from": "2025-13-01", "input": "1", "output": "1"}}', "not an ISO date"),
    ('{"p/m": {"from": "2025-01-01T10:00:00", "input": "1", "output": "1"}}',
     "needs an offset"),
    ('{"p/m": {"from": 20250101, "input": "1", "output": "1"}}', "ISO date or date-time"),
    ('{"p/m": [{"from": "2025-01-01", "input": "1", "output": "1"}, '
     '{"from": "2025-01-01T00:00:00Z", "input": "2", "output": "2"}]}', "same 'from'"),
    ("{not json", "DSH_PRICES is not JSON"),
])
def test_bad_tables_are_refused_naming_the_entry(raw: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        prices_from_text(raw)


def test_a_float_is_refused_when_not_read_exactly() -> None:
    with pytest.raises(ConfigError, match="a float is not exact"):
        parse_prices({"p/m": {"from": "2025-01-01", "input": 0.1, "output": "1"}})


# --- the ledger ------------------------------------------------------------------------

def _event(seq: int, type_: str, data: Any, time: int, **extra: Any) -> Event:
    return Event(type=type_, seq=seq, time=time, data=data, **extra)


def _call(seq: int, time: int, model: str, usage: dict[str, int]) -> Event:
    message = {"id": f"m{seq}", "role": "assistant", "content": [],
               "source": {"kind": "model", "provider": "deepseek", "model": model}}
    return _event(seq, "assistant/message", {"turn": 1, "step": 1, "message": message,
                                             "usage": usage}, time, source_event_seqs=())


def test_the_ledger_sums_by_tenant_model_and_hour_from_the_log() -> None:
    t0 = SEP_5_2025 + 10 * HOUR_MS
    log = [_event(0, TENANT_TYPE, {"tenant": "acme", "messageId": "c1"}, t0, ignorable=True),
           _call(1, t0 + 5, "deepseek-chat", {"inputTokens": 1000, "outputTokens": 100,
                                               "cacheReadTokens": 9000}),
           _call(2, t0 + HOUR_MS - 1, "deepseek-chat", {"inputTokens": 1, "outputTokens": 1}),
           _call(3, t0 + HOUR_MS, "deepseek-chat", {"inputTokens": 2, "outputTokens": 2}),
           _call(4, t0 + 9, "deepseek-reasoner", {"inputTokens": 5, "outputTokens": 5})]
    other = [_call(0, t0 + 7, "deepseek-chat", {"inputTokens": 10, "outputTokens": 0})]
    ledger = Ledger(TABLE)
    ledger.add_log("s1", log)
    ledger.add_log("s2", other)
    first = RowId("acme", t0, "deepseek", "deepseek-chat")
    counts, cost = ledger.rows[first]
    assert counts == TokenCounts(1001, 101, 9000, 0, 0, 2)
    assert cost.femto == (1001 * 280_000_000 + 9000 * 28_000_000 + 101 * 420_000_000)
    assert ledger.rows[RowId("acme", t0 + HOUR_MS, "deepseek", "deepseek-chat")][0].calls == 1
    assert ledger.rows[RowId("", t0, "deepseek", "deepseek-chat")][0].input_tokens == 10
    # "deepseek/*" prices a model without a key of its own: 5 x $1/M + 5 x $2/M
    assert ledger.rows[RowId("acme", t0, "deepseek", "deepseek-reasoner")][1].nanos == 15_000
    records = ledger.records()
    assert set(records) == {ledger_key("acme", t0, "deepseek", "deepseek-chat"),
                            ledger_key("acme", t0 + HOUR_MS, "deepseek", "deepseek-chat"),
                            ledger_key("", t0, "deepseek", "deepseek-chat"),
                            ledger_key("acme", t0, "deepseek", "deepseek-reasoner")}
    assert f"tenant//hour/{t0}/deepseek/deepseek-chat" in records


def test_the_first_valid_tenant_event_wins() -> None:
    t0 = SEP_5_2025
    log = [_event(0, TENANT_TYPE, {"tenant": "no/slash"}, t0, ignorable=True),
           _event(1, TENANT_TYPE, {"tenant": "acme"}, t0, ignorable=True),
           _event(2, TENANT_TYPE, {"tenant": "other"}, t0, ignorable=True),
           _call(3, t0, "deepseek-chat", {"inputTokens": 1, "outputTokens": 1})]
    ledger = Ledger(TABLE)
    ledger.add_log("s", log)
    assert [row.tenant for row in ledger.rows] == ["acme"]


def test_a_ledger_record_reads_back_as_a_line() -> None:
    row = RowId("acme", HOUR_MS, "deepseek", "deepseek-chat")
    record = ledger_record(row, TokenCounts(10, 20, 30, 40, 5, 2), Cost(1_500_000, 1, 1, 7))
    line = LedgerLine.from_record(record)
    assert (line.tenant, line.start_ms, line.model_key) == ("acme", HOUR_MS,
                                                            "deepseek/deepseek-chat")
    assert (line.input_tokens, line.cached_input_tokens, line.cache_write_tokens,
            line.output_tokens, line.calls) == (10, 30, 40, 20, 2)
    assert (line.cost_nanos, line.unpriced_calls, line.unpriced_tokens) == (2, 1, 7)
    unpriced = LedgerLine.from_record(ledger_record(row, TokenCounts(), Cost(0, 0, 1, 1)))
    assert unpriced.cost_nanos is None
    with pytest.raises(ValueError, match="not a tenant usage record"):
        LedgerLine.from_record({"kind": "model"})


def test_samples_keep_their_tenant_and_old_samples_read_as_the_default_tenant() -> None:
    sample = UsageSample("s", 3, 99, "p", "m", TokenCounts(1, 2, 0, 0, 0, 1), "acme")
    assert UsageSample.from_json(sample.to_json()) == sample
    old = {"session": "s", "seq": 3, "time": 99, "provider": "p", "model": "m",
           "usage": {"inputTokens": 1, "outputTokens": 2, "calls": 1}}
    assert UsageSample.from_json(old).tenant == ""
    assert "tenant" not in UsageSample.from_json(old).to_json()   # the old form, unchanged
