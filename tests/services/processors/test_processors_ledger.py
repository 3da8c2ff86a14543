"""The cost ledger in the processors, without a broker (tables are dicts, sends collected):
the session stage learns each session's tenant and keeps it across a restart; the usage
stage's ledger rows equal the ledger computed directly from the logs, whatever is
delivered twice, and after a rebuild of its sums from the table."""

from __future__ import annotations

import json
import random
from typing import Any

from processors_support import generated_sessions

from pipeline.adapters.kafka.records import InboxRecord, OutRecord
from pipeline.codec.avro import EventSerde
from pipeline.codec.outputs import OutputDecoder
from pipeline.codec.records import event_headers, record_key
from pipeline.core.events import Event
from pipeline.core.ledger import HOUR_MS, KIND, Ledger
from pipeline.core.prices import prices_from_text
from pipeline.core.tenants import TENANT_TYPE
from pipeline.core.usage import TokenCounts, UsageSample
from pipeline.services.processors.aggregation import UsageAggregator
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.folding import SessionFolder
from pipeline.services.processors.session_state import SessionState, SessionTables
from pipeline.settings import TopicNames

TOPICS = TopicNames("t.")
SERDE = EventSerde()
OUTPUTS = OutputDecoder()
BY_MODEL = "t.by-model"
HOUR_EDGE = 1_800_000_000_000 + HOUR_MS - 400   # 0.4 s before 2027-01-15T09:00Z
PRICES = prices_from_text(json.dumps({
    "p/a": [{"from": "2020-01-01", "input": "0.27", "cached_input": "0.07", "output": "1.1"},
            # a new price starting at the hour the sessions cross into
            {"from": "2027-01-15T09:00:00Z", "input": "0.28", "cached_input": "0.028",
             "output": "0.42"}],
    # model "b" has no price: its cost is unknown, counted apart
}))


def _logs() -> dict[str, list[Event]]:
    return generated_sessions(7, 12, "p", ["a", "b"], HOUR_EDGE, tenants=["acme", "", "bee"])


class Stages:
    """Both stages, with tables that survive a "restart" (a new stage on the same tables)."""

    def __init__(self) -> None:
        self.tables = SessionTables({}, {}, {})
        self.usage_table: dict[str, Any] = {}
        self.sent: list[OutRecord] = []
        self.offset = 0
        self.restart()

    def restart(self) -> None:
        counters = DeliveryCounters()
        self.folder = SessionFolder(self.tables, self._send, SERDE.decode, TOPICS, BY_MODEL,
                                    counters)
        self.agg = UsageAggregator(self.usage_table, self._send, TOPICS.usage, counters,
                                   lambda: [0], grace_ms=100, sizes={"minute": 60_000},
                                   prices=PRICES)

    async def _send(self, out: OutRecord) -> None:
        self.sent.append(out)

    def records(self, session_id: str, events: list[Event]) -> list[InboxRecord]:
        found = []
        for event in events:
            self.offset += 1
            found.append(InboxRecord(TOPICS.session_events, 0, self.offset,
                                     record_key(session_id), SERDE.encode(session_id, event),
                                     tuple(event_headers(event))))
        return found

    async def fold(self, records: list[InboxRecord]) -> None:
        await self.folder.handle_batch(records)
        await self.folder.persist()

    def samples(self) -> list[dict[str, Any]]:
        return [json.loads(o.value or b"") for o in self.sent if o.topic == BY_MODEL]

    def ledger(self) -> dict[str, Any]:
        """The usage topic's ledger rows, as compaction leaves them (last value per key)."""
        found = {}
        for out in self.sent:
            if out.topic == TOPICS.usage and out.key and out.key.startswith(b"tenant/"):
                found[out.key.decode()] = OUTPUTS.decode(out.value)
        return found


def _reference(logs: dict[str, list[Event]]) -> dict[str, Any]:
    ledger = Ledger(PRICES)
    for sid, events in logs.items():
        ledger.add_log(sid, events)
    return ledger.records()


async def test_the_session_stage_keeps_the_tenant_across_a_restart() -> None:
    stages = Stages()
    events = _logs()["p-s0"]
    assert events[0].type == TENANT_TYPE
    half = len(events) // 2
    await stages.fold(stages.records("p-s0", events[:half]))
    stages.restart()   # only the tables are left
    await stages.fold(stages.records("p-s0", events[half - 2:]))   # 2 redelivered
    state = SessionState.from_json("p-s0", stages.tables.sessions["p-s0"])
    assert state.usage.tenant == "acme"
    samples = stages.samples()
    assert samples and {UsageSample.from_json(s).tenant for s in samples} == {"acme"}
    assert len(samples) == sum(e.type == "assistant/message" for e in events)


async def test_a_session_without_a_tenant_event_is_in_the_default_tenant() -> None:
    stages = Stages()
    events = _logs()["p-s1"]
    assert all(e.type != TENANT_TYPE for e in events)
    await stages.fold(stages.records("p-s1", events))
    assert {UsageSample.from_json(s).tenant for s in stages.samples()} == {""}
    assert "tenant" not in stages.samples()[0]   # the JSON of a sample before tenants


async def test_ledger_equals_the_direct_sum_across_duplicates_and_rebuilds() -> None:
    stages, logs = Stages(), _logs()
    for sid, events in logs.items():
        await stages.fold(stages.records(sid, events))
    samples = stages.samples()
    rng = random.Random(3)
    for index, value in enumerate(samples):
        await stages.agg.handle(0, value)
        if rng.random() < 0.3:   # a crash: some of what came before comes again
            for again in samples[rng.randint(0, index):index + 1]:
                await stages.agg.handle(0, again)
        if rng.random() < 0.1:
            stages.restart()   # sums rebuilt from the table alone
    reference = _reference(logs)
    assert stages.agg.counters.usage_duplicates > 0
    assert stages.ledger() == reference
    assert {row["kind"] for row in reference.values()} == {KIND}
    assert {row["dsh.tenant"] for row in reference.values()} == {"acme", "", "bee"}
    hours = {row["startMs"] for row in reference.values()}
    assert len(hours) == 2, "the sessions cross an hour: two rows per tenant and model"
    rebuilt = Stages()
    rebuilt.usage_table.update(stages.usage_table)
    rebuilt.restart()
    assert {json.dumps(r, sort_keys=True) for r in rebuilt.agg.ledger_records()} == \
        {json.dumps(r, sort_keys=True) for r in reference.values()}


async def test_priced_and_unpriced_rows_and_model_totals_carry_their_cost() -> None:
    stages, logs = Stages(), _logs()
    for sid, events in logs.items():
        await stages.fold(stages.records(sid, events))
    for value in stages.samples():
        await stages.agg.handle(0, value)
    rows = stages.ledger().values()
    priced = [r for r in rows if r["gen_ai.request.model"] == "a"]
    unpriced = [r for r in rows if r["gen_ai.request.model"] == "b"]
    assert priced and all(r["dsh.cost.nanos"] > 0 and r["dsh.cost.unpriced_calls"] == 0
                          for r in priced)
    assert unpriced and all("dsh.cost.nanos" not in r for r in unpriced)
    assert all(r["dsh.cost.unpriced_calls"] == r["dsh.usage.calls"] > 0 for r in unpriced)
    models = {r["gen_ai.request.model"]: r for r in stages.agg.model_records()}
    assert "dsh.cost.nanos" not in models["b"]
    assert models["a"]["dsh.cost.nanos"] >= sum(r["dsh.cost.nanos"] for r in priced) - len(
        priced)   # rows round once each: their sum is within a nano-unit a row


async def test_a_late_sample_still_lands_in_its_hour() -> None:
    stages = Stages()
    early = UsageSample("s", 5, HOUR_EDGE, "p", "a", _counts(10), "acme")
    late = UsageSample("s", 9, HOUR_EDGE + 1, "p", "a", _counts(5), "acme")
    await stages.agg.handle(0, early.to_json())
    await stages.agg.handle(0, {"tick": HOUR_EDGE + 10 * HOUR_MS})   # every window closed
    await stages.agg.handle(0, late.to_json())
    assert stages.agg.counters.late_window_samples == 1
    (row,) = stages.ledger().values()
    assert row["dsh.usage.input_tokens"] == 15 and row["dsh.usage.calls"] == 2


def _counts(tokens: int) -> TokenCounts:
    return TokenCounts(tokens, 1, 0, 0, 0, 1)
