"""The dashboard's usage and cost by tenant: summed over the cost-ledger rows of the usage
topic (Avro records as the processors write them), and its ``dsh_dashboard_tenant_*``
metrics counting what the rows grew by."""

from __future__ import annotations

from dashboard_support import prometheus_samples

from pipeline.adapters.kafka.records import InboxRecord
from pipeline.codec.output_views import OutputView
from pipeline.codec.outputs import USAGE_RECORD, OutputDecoder, default_output_codecs
from pipeline.core.ledger import HOUR_MS, RowId, ledger_record
from pipeline.core.prices import Cost
from pipeline.core.usage import TokenCounts
from pipeline.services.dashboard.model import FleetModel

H0 = 1_757_030_400_000
VIEW = OutputView(OutputDecoder(), USAGE_RECORD)


class Feed:
    def __init__(self) -> None:
        self.model = FleetModel()
        self.offset = 0

    def row(self, row: RowId, counts: TokenCounts, cost: Cost) -> None:
        self.offset += 1
        value = default_output_codecs().usage.encode(ledger_record(row, counts, cost))
        change = VIEW.apply(InboxRecord("usage", 0, self.offset, row.key.encode(), value, ()))
        assert change is not None
        self.model.apply_usage(change)

    def metric(self, name: str, **labels: str) -> float | None:
        samples = prometheus_samples(self.model.metrics.render().decode())
        return samples.get((name, tuple(sorted(labels.items()))))


ACME = RowId("acme", H0, "deepseek", "chat")


def test_usage_by_tenant_sums_hours_and_keeps_unknown_cost_apart() -> None:
    feed = Feed()
    feed.row(ACME, TokenCounts(100, 10, 1000, 5, 0, 1), Cost(2 * 10**15, 1))
    feed.row(RowId("acme", H0 + HOUR_MS, "deepseek", "chat"),
             TokenCounts(50, 5, 0, 0, 0, 1), Cost(10**15, 1))
    feed.row(RowId("", H0, "openai", "gpt"), TokenCounts(7, 3, 0, 0, 0, 2),
             Cost(0, 0, 2, 10))
    usage = feed.model.tenant_usage()
    assert [(u["tenant"], u["provider"], u["model"]) for u in usage] == [
        ("", "openai", "gpt"), ("acme", "deepseek", "chat")]
    unpriced, acme = usage
    assert acme["inputTokens"] == 150 and acme["cachedInputTokens"] == 1000
    assert acme["calls"] == 2 and acme["hours"] == 2 and acme["costNanos"] == 3 * 10**9
    assert unpriced["costNanos"] is None and unpriced["unpricedCalls"] == 2   # never 0
    assert [u["hours"] for u in feed.model.tenant_usage(H0 + HOUR_MS)] == [1]


def test_tenant_metrics_count_what_the_rows_grew_by_and_a_repeat_counts_nothing() -> None:
    feed = Feed()
    feed.row(ACME, TokenCounts(100, 10, 1000, 5, 0, 1), Cost(2 * 10**15, 1))
    feed.row(ACME, TokenCounts(150, 20, 1000, 5, 0, 2), Cost(3 * 10**15, 2))   # grew
    feed.row(ACME, TokenCounts(150, 20, 1000, 5, 0, 2), Cost(3 * 10**15, 2))   # repeated
    labels = {"tenant": "acme", "provider": "deepseek", "model": "chat"}
    assert feed.metric("dsh_dashboard_tenant_tokens_total", direction="input", **labels) == 150
    assert feed.metric("dsh_dashboard_tenant_tokens_total", direction="cached_input",
                       **labels) == 1000
    assert feed.metric("dsh_dashboard_tenant_tokens_total", direction="output", **labels) == 20
    assert feed.metric("dsh_dashboard_tenant_cost_total", **labels) == 3.0
    feed.row(RowId("", H0, "openai", "gpt"), TokenCounts(7, 3, 0, 0, 0, 2), Cost(0, 0, 2, 10))
    other = {"tenant": "", "provider": "openai", "model": "gpt"}
    assert feed.metric("dsh_dashboard_tenant_unpriced_calls_total", **other) == 2
    assert feed.metric("dsh_dashboard_tenant_cost_total", **other) is None   # no price: no 0


def test_a_ledger_row_that_does_not_read_is_counted_not_kept() -> None:
    feed = Feed()
    broken = {**ledger_record(ACME, TokenCounts(), Cost()), "startMs": None}
    del broken["startMs"]
    value = default_output_codecs().usage.encode(broken)
    change = VIEW.apply(InboxRecord("usage", 0, 99, ACME.key.encode(), value, ()))
    assert change is not None
    feed.model.apply_usage(change)
    assert feed.model.tenant_usage() == []
    assert feed.metric("dsh_dashboard_undecodable_records_total", topic="usage") == 1
