"""The processors' record handling without a broker: tables are dicts, sends are collected.

Covers delivery (duplicates, gaps, chunks skipped undecoded, dead letters, invalid events),
crash consistency (replaying any suffix of the input changes nothing) and the per-model stage
(dedup by seq, rebuilt sums equal incremental sums, windows closed by ticks).
"""

from __future__ import annotations

import dataclasses
import json
import random
from types import SimpleNamespace
from typing import Any, cast

import pytest
from folding_support import SERDE, TOPICS, Harness, batches, sessions

from pipeline.adapters.kafka.records import InboxRecord, OutRecord
from pipeline.codec.outputs import OUTPUT_SCHEMAS, OutputCodecs, OutputDecoder
from pipeline.codec.records import record_key
from pipeline.core.errors import BrokerError
from pipeline.core.events import Event, Replace
from pipeline.core.log import derive_messages
from pipeline.core.projection import rebuild_conversations
from pipeline.core.usage import TokenCounts, UsageSample, UsageScan, session_record
from pipeline.services.processors.aggregation import IDLE_TICK_MS, UsageAggregator
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.folding import SessionFolder
from pipeline.services.processors.session_page import page_answer
from pipeline.services.processors.session_state import SessionState, SessionTables
from pipeline.services.processors.web import session_messages

OUTPUTS = OutputDecoder()


async def test_tables_equal_core_and_chunks_are_never_decoded() -> None:
    harness = Harness()
    logs = sessions()
    decoded: list[bytes] = []
    decode = harness.folder.decode
    harness.folder.decode = lambda data: (decoded.append(data), decode(data))[1]
    for sid, events in logs.items():
        await harness.feed([harness.record(sid, e) for e in events])
    for sid, events in logs.items():
        assert harness.messages(sid) == list(derive_messages(events))
    chunks = sum(1 for events in logs.values() for e in events if e.type == "assistant/chunk")
    assert harness.counters.chunks_skipped_undecoded == chunks
    assert len(decoded) == sum(len(e) for e in logs.values()) - chunks


async def test_replaying_any_suffix_changes_nothing() -> None:
    """At-least-once: after a crash, records from the last committed offset come again."""
    harness = Harness()
    (sid, events), = sessions(4, 1).items()
    records = [harness.record(sid, e) for e in events]
    await harness.feed(records)
    state, nodes = json.dumps(harness.tables.sessions), json.dumps(harness.tables.nodes)
    start = random.Random(0).randrange(len(records))
    await harness.feed(records[start:])
    assert json.dumps(harness.tables.sessions) == state
    assert json.dumps(harness.tables.nodes) == nodes
    assert harness.counters.duplicates == len(records) - start


def restarted(harness: Harness) -> Harness:
    """A new worker process on the same tables (what a restart recovers from changelogs)."""
    again = Harness()
    again.tables = SessionTables(harness.tables.sessions, harness.tables.nodes,
                                 harness.tables.chunk_marks)
    again.folder = SessionFolder(again.tables, again._send, SERDE.decode, TOPICS,
                                 "t.by-model", again.counters)
    again.offset = harness.offset
    return again


async def test_after_a_restart_redelivery_from_mid_chunk_run_has_no_false_gaps() -> None:
    harness = Harness()
    (sid, events), = sessions(9, 1).items()
    records = [harness.record(sid, e) for e in events]
    start = next(i for i, e in enumerate(events) if e.type == "assistant/chunk"
                 and i + 1 < len(events) and events[i + 1].type == "assistant/chunk") + 1
    await harness.feed_batch(records[:start])   # committed up to here: ends mid chunk run
    again = restarted(harness)
    await again.feed_batch(records[start:])
    assert again.counters.gaps == 0 and again.counters.duplicates == 0
    assert again.messages(sid) == list(derive_messages(events))


async def test_a_gap_next_to_a_restart_boundary_is_reported() -> None:
    """The chunk cursor is persisted at every batch end, so a seq missing right after the
    last committed batch is a gap, not mistaken for chunks folded before the crash."""
    harness = Harness()
    (sid, events), = sessions(9, 1).items()
    records = [harness.record(sid, e) for e in events]
    start = next(i for i, e in enumerate(events) if e.type == "assistant/chunk"
                 and i + 1 < len(events) and events[i + 1].type == "assistant/chunk") + 1
    await harness.feed_batch(records[:start])
    again = restarted(harness)
    await again.feed_batch(records[start + 1:])   # seq ``start`` never arrives
    assert again.counters.gaps == len(records) - start - 1
    assert again.messages(sid) == list(derive_messages(events[:start]))


async def test_after_a_restart_a_decoded_event_past_persisted_chunks_is_applied() -> None:
    harness = Harness()
    (sid, events), = sessions(10, 1).items()
    records = [harness.record(sid, e) for e in events]
    cut = next(i for i, e in enumerate(events) if i > 0 and e.type != "assistant/chunk"
               and events[i - 1].type == "assistant/chunk")
    await harness.feed_batch(records[:cut])
    again = restarted(harness)   # redelivery starts at the decoded event
    await again.feed_batch(records[cut:])
    assert again.counters.gaps == 0
    assert again.messages(sid) == list(derive_messages(events))


async def test_a_crash_losing_uncommitted_batches_recovers_to_the_full_fold() -> None:
    """kill -9: table writes of batches after the last commit may be lost, in any suffix;
    redelivery from the committed offset gives exactly the uninterrupted result."""
    logs = sessions(12, 4)
    full = Harness()
    records = [full.record(sid, e) for sid, events in logs.items() for e in events]
    # Sessions interleaved as on a shared partition (each one's records in seq order).
    records.sort(key=lambda r: (int(dict(r.headers)["dsh.seq"]), r.key or b""))
    parts = batches(records, 37)
    for committed in (1, len(parts) // 2, len(parts) - 1):
        crashed = Harness()
        for part in parts[:committed]:
            await crashed.feed_batch(part)
        snapshot = json.dumps([crashed.tables.sessions, crashed.tables.nodes,
                               crashed.tables.chunk_marks])
        await crashed.feed_batch(parts[committed])    # processed, never committed ...
        lost = Harness()                              # ... and its writes lost
        lost.tables = SessionTables(*json.loads(snapshot))
        again = restarted(lost)
        for part in parts[committed:]:
            await again.feed_batch(part)
        assert again.counters.gaps == 0
        for sid, events in logs.items():
            assert again.messages(sid) == list(derive_messages(events)), (committed, sid)


async def test_a_persist_writes_each_session_record_once_for_all_its_batches() -> None:
    harness = Harness()
    writes: list[str] = []

    class Recording(dict[str, Any]):
        def __setitem__(self, key: str, value: Any) -> None:
            writes.append(key)
            super().__setitem__(key, value)

    harness.tables = SessionTables(Recording(), {}, Recording())
    harness.folder.tables = harness.tables
    logs = sessions(13, 3)
    records = [harness.record(sid, e) for sid, events in logs.items() for e in events]
    records.sort(key=lambda r: (int(dict(r.headers)["dsh.seq"]), r.key or b""))
    parts = batches(records, 23)
    for part in parts:
        await harness.folder.handle_batch(part)
    assert writes == []                     # nothing is written before the commit
    await harness.folder.persist()
    assert sorted(writes) == sorted(logs)   # no chunk marks: the session records hold all
    for sid, events in logs.items():
        assert harness.messages(sid) == list(derive_messages(events))
        assert harness.tables.sessions[sid]["next"] == len(events)
    fleet = [o.key for o in harness.sent_to(TOPICS.fleet)]
    assert len(fleet) > len(logs)           # the last value of every batch, sent at once
    await harness.folder.persist()
    assert len(writes) == len(logs)         # nothing changed since: nothing written again


async def test_a_reported_gap_is_never_folded_past_after_a_restart() -> None:
    harness = Harness()
    (sid, events), = sessions(5, 1).items()
    records = [harness.record(sid, e) for e in events]
    await harness.feed([*records[:5], records[6]])
    again = restarted(harness)
    await again.feed(records[7:9])
    assert harness.counters.gaps + again.counters.gaps == 3
    assert again.messages(sid) == list(derive_messages(events[:5]))


async def test_gap_is_dead_lettered_with_its_reason_and_never_folded_past() -> None:
    harness = Harness()
    (sid, events), = sessions(5, 1).items()
    records = [harness.record(sid, e) for e in events]
    await harness.feed(records[:5] + records[6:])
    assert harness.messages(sid) == list(derive_messages(events[:5]))
    letters = harness.sent_to(TOPICS.dlq(TOPICS.session_events))
    assert len(letters) == harness.counters.gaps == len(records) - 6
    headers = dict(letters[0].headers)
    assert headers["dsh.error.class"] == b"SequenceError"
    assert b"expected seq 5, found 6 (gap)" in headers["dsh.error.message"]
    assert letters[0].value == records[6].value and letters[0].key == records[6].key
    # The missing record arrives late: folding resumes from it.
    await harness.feed([records[5], *records[6:]])
    assert harness.messages(sid) == list(derive_messages(events))


async def test_undecodable_record_is_dead_lettered_and_processing_goes_on() -> None:
    harness = Harness()
    (sid, events), = sessions(6, 1).items()
    garbage = InboxRecord(TOPICS.session_events, 2, 77, b"s", b"\xc3\x01 not avro", ())
    await harness.feed([garbage, *[harness.record(sid, e) for e in events]])
    (letter,) = harness.sent_to(TOPICS.dlq(TOPICS.session_events))
    headers = dict(letter.headers)
    assert headers["dsh.error.class"] == b"SchemaError"  # a CodecError: unknown fingerprint
    assert (headers["dsh.original.partition"], headers["dsh.original.offset"]) == (b"2", b"77")
    assert letter.value == garbage.value
    assert harness.messages(sid) == list(derive_messages(events))


async def test_an_invalid_replace_is_dead_lettered_and_the_session_stops_there() -> None:
    harness = Harness()
    msg = {"id": "u", "role": "user", "content": [{"type": "text", "text": "x"}]}
    good = Event("user/message", 0, 0, msg, "append")
    bad = Event("user/message", 1, 0, msg, Replace(7, 7), (0,))
    after = Event("user/message", 2, 0, msg, "append")
    await harness.feed([harness.record("s", e) for e in (good, bad, after)])
    assert harness.counters.invalid_events == 1 and harness.counters.gaps == 1
    assert harness.messages("s") == [msg]
    again = restarted(harness)   # a restart does not fold past the refused event
    await again.feed([again.record("s", after)])
    assert again.counters.gaps == 1 and again.messages("s") == [msg]
    classes = [dict(o.headers)["dsh.error.class"]
               for o in [*harness.sent, *again.sent]
               if o.topic == TOPICS.dlq(TOPICS.session_events)]
    assert classes == [b"EventError", b"SequenceError", b"SequenceError"]


async def test_published_changes_cost_the_size_of_the_change() -> None:
    harness = Harness()
    (sid, events), = sessions(8, 1).items()
    for event in events:
        before = len(harness.sent_to(TOPICS.derived_messages))
        await harness.feed([harness.record(sid, event)])
        published = len(harness.sent_to(TOPICS.derived_messages)) - before
        if event.surface_op is None:
            assert published == 0
        elif isinstance(event.surface_op, Replace):
            assert published == len(event.source_event_seqs or ())  # 1 record + tombstones
        else:
            assert published == 1


class AggHarness:
    def __init__(self, table: dict[str, Any] | None = None) -> None:
        self.table: dict[str, Any] = table if table is not None else {}
        self.sent: list[OutRecord] = []
        self.counters = DeliveryCounters()
        self.agg = UsageAggregator(self.table, self._send, "t.usage", self.counters,
                                   lambda: [0, 1], grace_ms=100, sizes={"s": 1000})

    async def _send(self, out: OutRecord) -> None:
        self.sent.append(out)

    def published(self) -> dict[str, Any]:
        return {o.key.decode(): OUTPUTS.decode(o.value) for o in self.sent if o.key and o.value}


def sample(session: str, seq: int, time: int, tokens: int, model: str = "m") -> dict[str, Any]:
    return UsageSample(session, seq, time, "p", model, TokenCounts(tokens, 1, 0, 0, 0, 1)
                       ).to_json()


async def test_usage_stage_dedups_by_seq_and_rebuilds_the_same_sums() -> None:
    harness = AggHarness()
    await harness.agg.handle(0, sample("a", 3, 100, 10))
    await harness.agg.handle(0, sample("a", 3, 100, 10))   # redelivered
    await harness.agg.handle(0, sample("b", 1, 200, 5))
    await harness.agg.handle(1, sample("c", 1, 300, 7, model="n"))
    assert harness.counters.usage_duplicates == 1
    totals = {r["gen_ai.request.model"]: r["dsh.usage.input_tokens"]
              for r in harness.agg.model_records()}
    assert totals == {"m": 15, "n": 7}
    # A new worker (or a restart) rebuilds the same sums from the table alone.
    again = AggHarness(harness.table)
    assert again.agg.model_records() == harness.agg.model_records()


async def test_usage_windows_close_on_ticks_and_late_samples_only_reach_totals() -> None:
    harness = AggHarness()
    await harness.agg.handle(0, sample("a", 1, 100, 10))
    await harness.agg.handle(0, {"tick": 1050})              # before end 1000 + grace 100
    await harness.agg.handle(0, sample("a", 2, 900, 1))      # late but within grace
    await harness.agg.handle(0, {"tick": 1100})
    window = harness.published()["window/s/0/p/m"]
    assert window["closed"] is True and window["dsh.usage.input_tokens"] == 11
    await harness.agg.handle(0, sample("a", 3, 950, 100))    # after the close
    assert harness.counters.late_window_samples == 1
    assert harness.published()["window/s/0/p/m"]["dsh.usage.input_tokens"] == 11
    assert harness.published()["model/p/m"]["dsh.usage.input_tokens"] == 111
    # A rebuild after the close does not reopen the window.
    assert AggHarness(harness.table).agg.current_sums().windows == {}


@pytest.mark.parametrize("seed", [1, 2])
async def test_session_and_model_totals_equal_a_full_scan(seed: int) -> None:
    harness, agg = Harness(), AggHarness()
    logs = sessions(seed, 6)
    for sid, events in logs.items():
        await harness.feed([harness.record(sid, e) for e in events])
    for out in harness.sent_to("t.by-model"):
        await agg.agg.handle(0, json.loads(out.value or b""))
    scan = UsageScan()
    for sid, events in logs.items():
        scan.add_log(sid, events)
        state = SessionState.from_json(sid, harness.tables.sessions[sid])
        assert state.usage.totals == scan.by_session[sid]
    found = {f"p/{r['gen_ai.request.model']}": r["dsh.usage.input_tokens"]
             for r in agg.agg.model_records()}
    assert found == {k: v.input_tokens for k, v in scan.by_model.items()}


async def test_sums_built_during_recovery_are_not_kept() -> None:
    harness = AggHarness()
    await harness.agg.handle(0, sample("a", 1, 100, 10))
    recovering = UsageAggregator(harness.table, harness._send, "t.usage", harness.counters,
                                 lambda: [0, 1], grace_ms=100, sizes={"s": 1000},
                                 epoch=lambda: None)
    assert recovering.current_sums().models["p/m"].input_tokens == 10
    assert recovering.sums.partitions is None   # rebuilt again once recovery is over


async def test_kept_sums_follow_what_a_rebalance_recovered_into_the_table() -> None:
    """A takeover on a loaded machine (the RocksDB kill -9 run: a model short by two samples
    for good): faust's consumer thread shows the new partition before the recovery starts,
    and a tick built the sums then, from this worker's standby copy of the partition, behind
    its changelog. The recovery then wrote the newer record, and the sample behind it, not
    committed by the old owner, came again as a duplicate. The sums are the table's once
    the rebalance is over, whatever was built meanwhile; and a rebalance that leaves the
    partitions as they were rebuilds them too (its recovery may have written)."""
    previous = AggHarness()   # the old owner of partition 1
    await previous.agg.handle(1, sample("b", 1, 100, 5, model="n"))
    table = dict(previous.table)   # this worker's standby copy of partition 1
    await previous.agg.handle(1, sample("b", 2, 150, 7, model="n"))   # uncommitted
    owned: list[int] = [0]
    epoch: list[int | None] = [1]
    counters = DeliveryCounters()
    agg = UsageAggregator(table, AggHarness()._send, "t.usage", counters, lambda: owned,
                          grace_ms=100, sizes={"s": 1000}, epoch=lambda: epoch[0])
    await agg.handle(0, sample("a", 1, 100, 10))

    def totals() -> dict[str, int]:
        return {r["gen_ai.request.model"]: r["dsh.usage.input_tokens"]
                for r in agg.model_records()}

    owned.append(1)   # the assignor first: the epoch still says settled
    assert totals() == {"m": 10, "n": 5}   # the standby copy
    epoch[0] = None   # the rebalance and its recovery
    table.update(previous.table)
    epoch[0] = 2
    await agg.handle(1, sample("b", 2, 150, 7, model="n"))   # folded again
    assert counters.usage_duplicates == 1
    assert totals() == {"m": 10, "n": 12}
    # The same partitions after the next rebalance, whose recovery wrote a record.
    table["contrib/p/n/c"] = {**table["contrib/p/n/b"], "session": "c"}
    assert totals() == {"m": 10, "n": 12}   # not seen before the rebalance is over
    epoch[0] = 3
    assert totals() == {"m": 10, "n": 24}


class RefusingTable(dict[str, Any]):
    """A usage table whose next ``refusals`` writes of a session's record raise (a store
    write or a changelog send that failed)."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    def __setitem__(self, key: str, value: Any) -> None:
        if key.startswith("contrib/") and self.refusals:
            self.refusals -= 1
            raise RuntimeError("the table refused the write")
        super().__setitem__(key, value)


async def test_a_sample_whose_record_was_not_written_is_not_in_the_sums() -> None:
    """A failed write fails the batch, which is folded again from the committed offset: the
    sample is then in the model total, its window and its ledger row once."""
    table = RefusingTable(refusals=2)
    harness = AggHarness(table)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            await harness.agg.handle(0, sample("a", 1, 100, 10))
    await harness.agg.handle(0, sample("a", 1, 100, 10))   # folded again
    published = harness.published()
    assert published["model/p/m"]["dsh.usage.input_tokens"] == 10
    assert published["window/s/0/p/m"]["dsh.usage.input_tokens"] == 10
    assert [r["dsh.usage.input_tokens"] for r in harness.agg.ledger_records()] == [10]
    rebuilt = AggHarness(dict(table)).agg
    assert harness.agg.model_records() == rebuilt.model_records()
    assert harness.agg.ledger_records() == rebuilt.ledger_records()


async def test_ticks_go_where_a_window_is_due_and_everywhere_at_least_every_idle_tick() -> None:
    harness = AggHarness()   # partitions 0 and 1, windows of 1,000 ms, grace 100 ms
    agg = harness.agg
    assert agg.partitions_to_tick([0, 1], 10_000) == [0, 1]   # never ticked: every one
    assert agg.partitions_to_tick([0, 1], 11_000) == []       # nothing open, ticked lately
    await agg.handle(0, sample("a", 1, 11_500, 10))           # opens [11,000, 12,000) in 0
    assert agg.partitions_to_tick([0, 1], 12_050) == []       # not due before 12,100
    assert agg.partitions_to_tick([0, 1], 12_100) == [0]
    await agg.handle(0, {"tick": 12_100})
    assert harness.published()["window/s/11000/p/m"]["closed"] is True
    assert agg.partitions_to_tick([0, 1], 13_000) == []       # closed: nothing due
    assert agg.partitions_to_tick([0, 1], 10_000 + IDLE_TICK_MS) == [1]
    assert agg.partitions_to_tick([0, 1], 12_100 + IDLE_TICK_MS) == [0]
    recovering = UsageAggregator(harness.table, harness._send, "t.usage", harness.counters,
                                 lambda: [0, 1], grace_ms=100, sizes={"s": 1000},
                                 epoch=lambda: None)
    assert recovering.partitions_to_tick([0, 1], 10_000) == [0, 1]
    assert recovering.partitions_to_tick([0, 1], 10_001) == [0, 1]   # every tick meanwhile


async def test_http_views_read_the_fold_so_far_and_it_is_consistent_at_every_await() -> None:
    """Sends await (other tasks, such as HTTP views, run meanwhile): at every send the
    messages a view derives from the session's current state and the ``nodes`` table are
    exactly core's derivation of the events folded so far, persisted or not."""
    harness = Harness()
    (sid, events), = sessions(14, 1).items()
    processors = SimpleNamespace(tables=harness.tables, folder=harness.folder)
    seen: list[int] = []

    async def checking_send(out: OutRecord) -> None:
        body = session_messages(cast(Any, processors), sid)
        assert body is not None
        folded = body["nextSeq"]
        assert body["messages"] == list(derive_messages(events[:folded])), folded
        seen.append(folded)

    harness.folder.send = checking_send
    records = [harness.record(sid, e) for e in events]
    for part in batches(records, 25):
        await harness.folder.handle_batch(part)   # never persisted
    assert harness.tables.sessions == {}
    assert len(seen) > 10 and seen == sorted(seen)
    body = session_messages(cast(Any, processors), sid)
    assert body is not None and body["nextSeq"] == len(events)
    assert body["messages"] == list(derive_messages(events))


class CoveredUpTo:
    """A route as after a switch: offsets below ``covered`` were published by the rebuild."""

    def __init__(self, topic: str, covered: int) -> None:
        self.topic, self.covered = topic, covered
        self.gates: list[tuple[int, int]] = []

    async def gate(self, partition: int, offset: int) -> str | None:
        self.gates.append((partition, offset))
        return self.topic_for(partition, offset)

    def topic_for(self, partition: int, offset: int) -> str | None:
        return None if offset < self.covered else self.topic

    def partition_of(self, partition: int) -> int | None:
        return 7 + partition   # not the default partitioner's (None): seen on the records


async def test_a_route_sends_derived_changes_to_its_version_and_none_below_covered() -> None:
    harness = Harness()
    logs = sessions(count=1)
    [(sid, events)] = logs.items()
    records = [harness.record(sid, e) for e in events]
    covered = records[len(records) // 2].offset
    route = CoveredUpTo("t.derived-messages.v1", covered)
    harness.folder.route = route
    await harness.feed_batch(records[:10])
    await harness.feed_batch(records[10:])
    assert route.gates == [(0, records[0].offset), (0, records[10].offset)]  # once a batch
    assert harness.sent_to(TOPICS.derived_messages) == []
    published = harness.sent_to("t.derived-messages.v1")
    unrouted = Harness()  # the same records without a route: changes per record offset
    expected = 0
    for record in records:
        before = len(unrouted.sent_to(TOPICS.derived_messages))
        await unrouted.feed([record])
        if record.offset >= covered:
            expected += len(unrouted.sent_to(TOPICS.derived_messages)) - before
    assert 0 < len(published) == expected
    assert {o.partition for o in published} == {7}   # where the route says
    assert harness.messages(sid) == list(derive_messages(events))  # folded all the same


@pytest.mark.parametrize("registry", [False, True])
async def test_outputs_are_avro_records_that_decode_to_core_folds(registry: bool) -> None:
    """Every derived output value is Avro (single-object, or Confluent with registry ids);
    decoded, the derived messages are core's derivation, fleet status the table's, and the
    session usage a full scan's."""
    harness = Harness()
    if registry:
        ids = {name: 40 + i for i, name in enumerate(OUTPUT_SCHEMAS)}
        harness.folder.outputs = OutputCodecs.confluent(ids, lookup=None)
    logs = sessions(5, 4)
    for sid, events in logs.items():
        await harness.feed_batch([harness.record(sid, e) for e in events])
    reader = OutputDecoder(harness.folder.outputs.derived.table)
    outputs = [o for o in harness.sent
               if o.topic in (TOPICS.derived_messages, TOPICS.usage, TOPICS.fleet)]
    framing = b"\x00\x00\x00\x00" if registry else b"\xc3\x01"
    assert outputs and all(o.value is None or o.value.startswith(framing) for o in outputs)
    last = {(o.topic, (o.key or b"").decode()): reader.decode(o.value) for o in outputs}
    derived = [(o.key.decode(), reader.decode(o.value))
               for o in harness.sent_to(TOPICS.derived_messages) if o.key]
    scan = UsageScan()
    for sid, events in logs.items():
        assert rebuild_conversations(derived)[sid] == list(derive_messages(events))
        state = SessionState.from_json(sid, harness.tables.sessions[sid])
        assert last[(TOPICS.fleet, sid)] == (state.fleet.to_json() if state.fleet else None)
        scan.add_log(sid, events)
        assert last[(TOPICS.usage, f"session/{sid}")] == session_record(
            sid, scan.by_session[sid])


def page_holds(harness: Harness, records: list[InboxRecord], logs: dict[str, list[Event]],
               committed: int) -> None:
    """The page answer of every session keeps its rule: every event of the session below
    ``fromOffset`` is in the answer (seq < nextSeq), the events from there on continue it
    without a hole, and its messages are core's derivation of the events it holds."""
    for sid, events in logs.items():
        body = page_answer(harness.tables, harness.folder, sid, 0, committed)
        assert body is not None
        next_seq, from_offset = body["nextSeq"], body["fromOffset"]
        assert isinstance(next_seq, int) and isinstance(from_offset, int)
        ours = [(r.offset, int(dict(r.headers)["dsh.seq"])) for r in records
                if r.key == record_key(sid)]
        assert all(seq < next_seq for offset, seq in ours if offset < from_offset), sid
        later = [seq for offset, seq in ours if offset >= from_offset and seq >= next_seq]
        assert later == list(range(next_seq, next_seq + len(later))), sid
        messages = [m for m in body["messages"] if m is not None]   # type: ignore[union-attr]
        assert messages == list(derive_messages(events[:next_seq])), sid


async def test_a_dashboard_page_answer_holds_at_every_await_and_after_a_give_up() -> None:
    """``GET /sessions/{id}/page``'s answer, read at every send of the folds (other tasks
    run there), and after a batch that fails part way (its cached states given up)."""
    logs = sessions(21, 3)
    harness = Harness()
    records = [harness.record(sid, e) for sid, events in logs.items() for e in events]
    records.sort(key=lambda r: (int(dict(r.headers)["dsh.seq"]), r.key or b""))
    records = [dataclasses.replace(r, offset=n) for n, r in enumerate(records)]
    committed, checks = 0, 0

    async def checking_send(out: OutRecord) -> None:
        nonlocal checks
        page_holds(harness, records, logs, committed)
        checks += 1

    harness.folder.send = checking_send
    parts = batches(records, 29)
    for part in parts[:len(parts) // 2]:
        await harness.feed_batch(part)
        committed = part[-1].offset + 1
    assert harness.folder.folded_to == {0: committed - 1}

    async def failing_send(out: OutRecord) -> None:
        raise BrokerError("the broker went away")
    harness.folder.send = failing_send
    with pytest.raises(BrokerError):
        await harness.folder.handle_batch(parts[len(parts) // 2])
    assert harness.folder.folded_to == {}     # no longer vouched for: the committed offset is
    page_holds(harness, records, logs, committed)
    harness.folder.send = checking_send
    for part in parts[len(parts) // 2:]:      # read again from the committed offset
        await harness.feed_batch(part)
        committed = part[-1].offset + 1
    page_holds(harness, records, logs, committed)
    assert checks > 20
