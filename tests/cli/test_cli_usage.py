"""``dsh-pipeline usage`` without a broker: its options, errors, filter, totals and table
(the broker run is in ``tests/services/processors/test_processors_ledger_kill.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli.cmd_usage import instant_ms, ledger_lines, render_table, totals
from pipeline.core.errors import ConfigError
from pipeline.core.ledger import HOUR_MS, RowId, ledger_record
from pipeline.core.prices import Cost
from pipeline.core.usage import TokenCounts

ROOT = Path(__file__).resolve().parents[2]
H0 = 1_757_030_400_000   # 2025-09-05T00:00:00Z


def _record(tenant: str, hour: int, model: str, cost: Cost) -> dict[str, object]:
    return ledger_record(RowId(tenant, H0 + hour * HOUR_MS, "deepseek", model),
                         TokenCounts(1000, 200, 3000, 40, 10, 2), cost)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli.main", "usage", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "DSH_BOOTSTRAP_SERVERS": "127.0.0.1:1"})


def test_times_are_iso_and_naive_ones_utc() -> None:
    assert instant_ms("2025-09-05", "--from") == H0
    assert instant_ms("2025-09-05T01:00Z", "--from") == H0 + HOUR_MS
    assert instant_ms("2025-09-05T03:00:00+02:00", "--to") == H0 + HOUR_MS
    with pytest.raises(ConfigError, match="--to 'yesterday': give an ISO 8601"):
        instant_ms("yesterday", "--to")


def test_rows_are_filtered_by_hour_start_and_sorted() -> None:
    values = [_record("acme", 2, "chat", Cost(5 * 10**15, 2)),
              _record("acme", 0, "chat", Cost(10**15, 2)),
              _record("", 1, "chat", Cost(0, 0, 2, 4240)),
              _record("acme", 1, "reasoner", Cost(10**15, 1, 1, 2120))]
    lines = ledger_lines(values, H0, H0 + 2 * HOUR_MS)
    assert [(line.tenant, line.model, line.start_ms) for line in lines] == [
        ("", "chat", H0 + HOUR_MS), ("acme", "chat", H0), ("acme", "reasoner", H0 + HOUR_MS)]
    total = totals(lines)
    assert total["costNanos"] == 2 * 10**9 and total["unpricedCalls"] == 3
    assert total["calls"] == 6 and total["cachedInputTokens"] == 9000
    assert totals(lines[:1])["costNanos"] is None   # no priced call: no cost, not 0
    table = render_table(lines)
    assert "2025-09-05T01:00Z" in table and "1.000000000" in table
    unpriced = next(row for row in table.splitlines() if row.startswith('""'))
    assert " - " in unpriced and "0.000000000" not in unpriced
    assert table.splitlines()[-2].startswith("total") and "2.000000000" in table
    assert table.endswith("3 rows; cost: nano-unit sums of the price table's currency, '-' "
                          "where no call had a price")


def test_help_says_what_it_reads_and_how_cost_is_shown() -> None:
    done = _cli("--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for words in ("--tenant", "--from ISO", "--to ISO", "--json", "never the session topic",
                  "DSH_PRICES", "never cost 0"):
        assert words in text


@pytest.mark.parametrize(("args", "message"), [
    (("--tenant", "a/b"), "tenant 'a/b' is not a valid name"),
    (("--from", "2025-09-06", "--to", "2025-09-05"), "--from 2025-09-06 is not before --to"),
    (("--from", "soon"), "--from 'soon': give an ISO 8601 date or time"),
])
def test_bad_options_are_usage_errors_before_any_broker(args: tuple[str, ...],
                                                        message: str) -> None:
    done = _cli(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
