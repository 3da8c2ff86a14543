"""When the session folds write their tables: once per commit, after their outputs' acks.

No broker: tables are dicts and every send returns a future the test resolves (as the
producer's delivery), so the order of acknowledgements, table writes and "folded" marks
is observable. The real worker runs the same code in ``test_processors_recovery.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from folding_support import Harness, batches, sessions

from pipeline.adapters.faust import pending
from pipeline.adapters.kafka.records import InboxRecord, OutRecord
from pipeline.core.log import derive_messages
from pipeline.services.processors import planning


class Acks:
    """Sends whose deliveries the test acknowledges (or fails) when it chooses."""

    def __init__(self, harness: Harness) -> None:
        self.pending: list[tuple[OutRecord, asyncio.Future[None]]] = []
        harness.folder.send = self.send
        self.harness = harness

    async def send(self, out: OutRecord) -> asyncio.Future[None]:
        self.harness.sent.append(out)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending.append((out, future))
        return future

    def ack_all(self) -> None:
        for _, future in self.pending:
            if not future.done():
                future.set_result(None)
        self.pending = []

    def fail_all(self) -> None:
        for _, future in self.pending:
            if not future.done():
                future.set_exception(RuntimeError("broker said no"))
        self.pending = []


def on_partition(harness: Harness, records: list[InboxRecord], partition: int
                 ) -> list[InboxRecord]:
    return [InboxRecord(r.topic, partition, r.offset, r.key, r.value, r.headers)
            for r in records]


async def test_states_are_written_only_after_every_output_is_acknowledged() -> None:
    harness = Harness()
    acks = Acks(harness)
    (sid, events), = sessions(21, 1).items()
    records = [harness.record(sid, e) for e in events]
    for number, part in enumerate(batches(records, 40)):
        await harness.folder.handle_batch(part, number)
    persist = asyncio.ensure_future(harness.folder.persist())
    await asyncio.sleep(0.01)
    assert not persist.done()
    assert harness.tables.sessions == {}                 # outputs not acknowledged yet
    acks.ack_all()
    outcome = await persist
    assert harness.tables.sessions[sid]["next"] == len(events)
    assert outcome.folded == list(range(len(batches(records, 40))))  # all, in fold order
    assert harness.messages(sid) == list(derive_messages(events))


async def test_folds_go_on_while_a_persist_waits_and_the_next_persist_writes_them() -> None:
    harness = Harness()
    acks = Acks(harness)
    (sid, events), = sessions(22, 1).items()
    records = [harness.record(sid, e) for e in events]
    half = len(records) // 2
    await harness.folder.handle_batch(records[:half])
    persist = asyncio.ensure_future(harness.folder.persist())
    await asyncio.sleep(0)
    await harness.folder.handle_batch(records[half:])    # not blocked by the persist
    acks.pending[0][1].set_result(None)
    acks.ack_all()
    await persist
    # The record written is the state as the persist took it, not the state folded since.
    assert harness.tables.sessions[sid]["next"] == half
    await harness.folder.persist()
    assert harness.tables.sessions[sid]["next"] == len(events)
    assert harness.messages(sid) == list(derive_messages(events))


async def test_an_unacknowledged_output_gives_up_its_partition_alone() -> None:
    harness = Harness()
    acks = Acks(harness)
    logs = sessions(23, 2)
    (bad, bad_events), (good, good_events) = logs.items()
    bad_records = on_partition(harness, [harness.record(bad, e) for e in bad_events], 0)
    good_records = on_partition(harness, [harness.record(good, e) for e in good_events], 1)
    await harness.folder.handle_batch(bad_records[:30], "bad")
    await harness.folder.handle_batch(good_records, "good")
    for out, future in acks.pending:
        if out.key and bad.encode() in out.key:
            future.set_exception(RuntimeError("broker said no"))
    acks.ack_all()
    outcome = await harness.folder.persist()
    assert outcome.folded == ["good"]                 # the failed batch never commits
    assert bad not in harness.tables.sessions
    assert harness.tables.sessions[good]["next"] == len(good_events)
    assert harness.counters.failed_batches == 1
    given_up = [(partition, str(exc)) for partition, exc in outcome.given_up]
    assert given_up == [(0, "broker said no")]        # the worker reads partition 0 again
    assert (outcome.refused, outcome.lost_write) == (None, None)
    # Read again from the committed offset (here: its first record), it is folded whole,
    # with no gap and nothing dead-lettered.
    await harness.folder.handle_batch(bad_records[:30])
    await harness.folder.handle_batch(bad_records[30:])
    acks.ack_all()
    await harness.folder.persist()
    assert (harness.counters.gaps, harness.counters.dead_letters) == (0, 0)
    assert harness.tables.sessions[bad]["next"] == len(bad_events)
    assert harness.messages(bad) == list(derive_messages(bad_events))


async def test_a_failing_fold_gives_up_its_partitions_unpersisted_batches() -> None:
    harness = Harness()
    logs = sessions(24, 2)
    (one, one_events), (other, other_events) = logs.items()
    one_records = on_partition(harness, [harness.record(one, e) for e in one_events], 0)
    other_records = on_partition(harness, [harness.record(other, e) for e in other_events], 1)
    await harness.folder.handle_batch(one_records[:20])
    await harness.folder.handle_batch(other_records)
    decode = harness.folder.decode

    def broken(value: bytes) -> Any:
        raise RuntimeError("a bug in the fold")

    harness.folder.decode = broken
    with pytest.raises(RuntimeError):
        await harness.folder.handle_batch(
            [r for r in one_records[20:] if dict(r.headers)["dsh.type"] != b"assistant/chunk"])
    harness.folder.decode = decode
    await harness.folder.persist()
    assert one not in harness.tables.sessions          # given up with the failing batch
    assert one not in harness.folder.states
    assert harness.tables.sessions[other]["next"] == len(other_events)
    assert harness.counters.failed_batches == 1        # the earlier batch of partition 0


async def test_the_state_cache_never_evicts_a_state_the_tables_do_not_have(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planning, "STATE_CACHE_MAX", 2)
    harness = Harness()
    logs = sessions(25, 6)
    records = [harness.record(sid, e) for sid, events in logs.items() for e in events]
    records.sort(key=lambda r: (int(dict(r.headers)["dsh.seq"]), r.key or b""))
    for part in batches(records, 17):
        await harness.folder.handle_batch(part)
    await harness.folder.persist()
    assert harness.counters.gaps == 0 and harness.counters.duplicates == 0
    for sid, events in logs.items():
        assert harness.messages(sid) == list(derive_messages(events))


async def test_a_rebalance_drops_what_was_not_persisted() -> None:
    harness = Harness()
    (sid, events), = sessions(26, 1).items()
    records = [harness.record(sid, e) for e in events]
    await harness.feed_batch(records[:40])
    persisted = dict(harness.tables.sessions[sid])
    await harness.folder.handle_batch(records[40:], 1)
    await harness.folder.forget()
    outcome = await harness.folder.persist()
    assert outcome.folded == [] and harness.tables.sessions[sid] == persisted
    # Redelivery from the committed offset folds the rest exactly once.
    await harness.feed_batch(records[40:])
    assert harness.counters.gaps == 0
    assert harness.messages(sid) == list(derive_messages(events))


async def test_a_fold_failing_while_a_persist_waits_continues_from_what_it_holds() -> None:
    """The persist took the partition's changes and waits for acks; a later batch of the
    same partition fails: its sessions go back to the record the persist is about to write,
    not to the older table record (which would turn their next records into gaps)."""
    harness = Harness()
    acks = Acks(harness)
    (sid, events), = sessions(27, 1).items()
    records = [harness.record(sid, e) for e in events]
    await harness.folder.handle_batch(records[:60])
    persist = asyncio.ensure_future(harness.folder.persist())
    await asyncio.sleep(0)                    # the persist holds the first 60 records

    async def refused(out: OutRecord) -> Any:
        raise RuntimeError("the producer refused it")

    harness.folder.send = refused
    with pytest.raises(RuntimeError):   # fails after folding into the cached state
        await harness.folder.handle_batch(records[60:])
    harness.folder.send = acks.send
    await harness.folder.handle_batch(records[60:])   # redelivered while the persist waits
    assert not persist.done()
    acks.ack_all()
    await persist
    await harness.folder.persist()
    assert harness.counters.gaps == 0
    assert harness.messages(sid) == list(derive_messages(events))


@pytest.mark.parametrize("last_output_fails", [False, True])
async def test_a_commits_worth_of_batches_is_marked_in_order_or_not_at_all(
        last_output_fails: bool) -> None:
    """The persist acknowledges outputs and marks batches a slice at a time (so that the
    folds go on in between): every batch is marked, in fold order, once every output of its
    partition is acknowledged; a failure in a late slice marks none."""
    harness = Harness()
    acks = Acks(harness)
    records = [harness.record(sid, e) for sid, events in sessions(24, 8).items()
               for e in events]
    parts = batches(records, 1)
    assert len(parts) > 2 * pending.SLICE
    for number, part in enumerate(parts):
        await harness.folder.handle_batch(part, number)
    assert len(acks.pending) > 2 * pending.SLICE
    if last_output_fails:
        acks.pending[-1][1].set_exception(RuntimeError("broker said no"))
    acks.ack_all()
    outcome = await harness.folder.persist()
    assert outcome.folded == ([] if last_output_fails else list(range(len(parts))))
    assert harness.counters.failed_batches == (len(parts) if last_output_fails else 0)
    assert (harness.tables.sessions == {}) is last_output_fails


async def test_session_records_are_written_only_after_their_nodes_are_acknowledged() -> None:
    """The tables' changelogs are separate topics: a kill -9 can keep a session record and
    lose the nodes it names (seen in the chaos campaign: messages missing for good, the
    record's seqs skipped as duplicates by every later owner). So the persist waits for
    the node writes before it writes a record; a lost write writes no record, marks no
    batch folded and stops the worker."""
    harness = Harness()
    (sid, events), = sessions(24, 1).items()
    seen_at_flush: list[tuple[int, bool]] = []

    async def flush() -> None:
        seen_at_flush.append((len(harness.tables.nodes), sid in harness.tables.sessions))

    await harness.folder.handle_batch([harness.record(sid, e) for e in events], "folded")
    outcome = await harness.folder.persist(flush)
    assert seen_at_flush and seen_at_flush[0][0] > 0            # the nodes were written...
    assert seen_at_flush[0][1] is False                         # ...the record not yet
    assert harness.messages(sid) == list(derive_messages(events))
    assert outcome.folded == ["folded"]

    (other, other_events) = list(sessions(25, 2).items())[1]     # another session id
    assert other != sid

    async def failing_flush() -> None:
        raise RuntimeError("a changelog write expired")

    await harness.folder.handle_batch([harness.record(other, e) for e in other_events],
                                      "lost")
    outcome = await harness.folder.persist(failing_flush)
    assert str(outcome.lost_write) == "a changelog write expired"
    assert outcome.given_up == []                     # the worker stops: none read again
    assert other not in harness.tables.sessions and outcome.folded == []
