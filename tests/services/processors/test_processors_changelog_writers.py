"""A changelog partition written by two workers at once (issue 31, seed 22142).

The processors write their tables without transactions, so a worker that lost a partition
can still write to its changelog after the new owner did (the chaos campaign's changelogs
show one producer, another, then the first again). These tests drive faust's real table
and stores (memory and RocksDB) through the two places where faust assumes one writer, with
the changelog records and acknowledgements such an interleaving produces; no broker is
needed to replay them exactly.

- A late acknowledgement moved the RocksDB store's changelog offset past the other
  writer's records, so a later recovery of the partition on that worker skipped them: a
  session the other owner created was missing from the store for good, and its valid
  events were dead-lettered as gaps ("expected seq 0, found 46").
- A late write older than the value before it was applied as the key's last value.
- Compaction then kept that late older record, the last by offset, and deleted the newer one
  before it: every rebuild from an empty store restored the older value (seed 1796662786).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faust
import pytest
from faust.events import Event
from faust.types.tuples import TP, ConsumerMessage, RecordMetadata

from pipeline.adapters.faust.tables import ChangelogTable, next_stored_offset
from pipeline.services.processors.session_state import chunk_mark_older, session_record_older

CHANGELOG = "t-sessions-changelog"


def make_table(tmp_path: Path, store: str, name: str = "sessions") -> Any:
    app = faust.App(f"t-{name}", broker="kafka://127.0.0.1:1", store=store,
                    datadir=str(tmp_path), autodiscover=False, Table=ChangelogTable,
                    key_serializer="raw", value_serializer="raw")
    table = app.Table(name, default=None, partitions=1, key_type=str,
                      older=session_record_older)
    table.key_serializer = "raw"
    table.changelog_topic = table._new_changelog_topic()
    return table


@pytest.fixture(params=["memory://", "rocksdb://"])
def table(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    yield make_table(tmp_path, request.param)


def changelog_event(table: Any, offset: int, key: str, value: Any) -> Any:
    """A record of the table's changelog as recovery hands it to the table."""
    raw = None if value is None else table.changelog_topic.prepare_value(
        value, table.value_serializer)[0]
    message = ConsumerMessage(CHANGELOG, 0, offset, 0.0, 0, [], key.encode(), raw, None, 0,
                              0, TP(CHANGELOG, 0))
    return Event(table.app, key, value, [], message)


def acknowledge(table: Any, offset: int) -> None:
    """The producer's acknowledgement of one of the table's own changelog writes."""
    future: asyncio.Future[RecordMetadata] = asyncio.get_event_loop().create_future()
    future.set_result(RecordMetadata(CHANGELOG, 0, TP(CHANGELOG, 0), offset, 0.0, 0))
    table._on_changelog_sent(future)


def written(table: Any) -> list[tuple[int, str, Any]]:
    """The changelog records the table sent (partition, key, value), taken from the app's
    producer buffer (nothing is connected: they would go out at the next flush)."""
    pending = table.app.producer.buffer.pending
    sent = []
    while not pending.empty():
        message = pending.get_nowait().message
        sent.append((message.partition, message.key.decode(), json.loads(message.value)))
    return sent


def compacted(log: list[Any]) -> list[Any]:
    """What Kafka's log cleaner keeps of a changelog: each key's last record by offset."""
    last = {event.key: event for event in log}
    return sorted(last.values(), key=lambda event: event.message.offset)


def record(next_seq: int) -> dict[str, Any]:
    return {"next": next_seq, "partition": 0}


def test_the_stored_offset_moves_only_to_the_very_next_offset() -> None:
    assert next_stored_offset(None, 0) == 0
    assert next_stored_offset(None, 5) is None
    assert next_stored_offset(9, 10) == 10
    assert next_stored_offset(9, 12) == 9     # 10 and 11 are another writer's
    assert next_stored_offset(9, 4) == 9      # an old acknowledgement


async def test_recovery_after_a_late_write_reads_the_other_writers_records(
        tmp_path: Path) -> None:
    """Seed 22142's missing session, on the RocksDB store."""
    table = make_table(tmp_path, "rocksdb://")
    tp = TP(CHANGELOG, 0)
    changelog = [changelog_event(table, offset, "old", record(10 + offset))
                 for offset in range(10)]                          # what recovery read
    table.apply_changelog_batch(changelog)
    acknowledge(table, 10)                                         # its own next write
    changelog += [changelog_event(table, 10, "old", record(20)),
                  changelog_event(table, 11, "new", record(46))]   # the new owner's
    acknowledge(table, 12)                                         # its late write
    changelog.append(changelog_event(table, 12, "old", record(20)))
    assert table.persisted_offset(tp) == 10    # faust's own rule: 12, past "new"
    # Recovery on this worker reads past the stored offset, as faust's does.
    table.apply_changelog_batch(changelog[table.persisted_offset(tp) + 1:])
    assert table.data.get("new") == record(46)


async def test_a_late_older_record_does_not_replace_a_newer_one(table: Any) -> None:
    table.apply_changelog_batch([changelog_event(table, 0, "s", record(60)),
                                 changelog_event(table, 1, "s", record(50)),
                                 changelog_event(table, 2, "t", record(3))])
    assert table.data.get("s") == record(60)
    assert table.data.get("t") == record(3)
    assert table.stale_skipped == 1
    # Across two reads too (a standby's next poll): the held value is the reference.
    table.apply_changelog_batch([changelog_event(table, 3, "s", record(55)),
                                 changelog_event(table, 4, "s", record(61))])
    assert table.data.get("s") == record(61)
    assert table.stale_skipped == 2


async def test_an_equal_or_newer_record_and_a_tombstone_are_applied(table: Any) -> None:
    stalled = {**record(7), "stalled": True}
    table.apply_changelog_batch([changelog_event(table, 0, "s", record(7)),
                                 changelog_event(table, 1, "s", stalled),
                                 changelog_event(table, 2, "u", record(1)),
                                 changelog_event(table, 3, "u", None)])
    assert table.data.get("s") == stalled
    assert table.data.get("u") is None
    assert table.stale_skipped == 0


def test_chunk_marks_compare_as_cursors() -> None:
    assert chunk_mark_older(12, 11)
    assert not chunk_mark_older(12, 12)
    assert not chunk_mark_older(12, 13)
    assert session_record_older(record(9), record(8))
    assert not session_record_older(record(9), record(9))


async def test_a_skipped_late_record_is_followed_by_the_held_value_so_compaction_keeps_it(
        table: Any, tmp_path: Path) -> None:
    """Seed 1796662786: the new owner's record, the old owner's late older one after it, the
    session quiet from then on. The owner's recovery skips the late record and writes the
    value it holds again; compaction keeps that; a rebuild from an empty store holds it."""
    log = [changelog_event(table, 0, "s", record(89)),    # the new owner's
           changelog_event(table, 1, "s", record(76)),    # the stopped worker's, late
           changelog_event(table, 2, "t", record(5))]
    table.apply_changelog_batch(log)
    await table.on_recovery_completed({TP(CHANGELOG, 0)}, set())
    assert written(table) == [(0, "s", record(89))]
    assert table.stale_rewritten == 1
    log.append(changelog_event(table, 3, "s", record(89)))
    rebuilt = make_table(tmp_path / "rebuilt", "memory://")
    rebuilt.apply_changelog_batch(compacted(log))
    assert rebuilt.data.get("s") == record(89)
    assert rebuilt.data.get("t") == record(5)
    # Written once: the next recovery has nothing left to write again.
    await table.on_recovery_completed({TP(CHANGELOG, 0)}, set())
    assert written(table) == []


async def test_a_standby_writes_the_held_value_again_at_its_promotion_only(
        tmp_path: Path) -> None:
    """On RocksDB (a memory store keeps no standby copy: faust drops it when the recovery
    ends, and a promotion reads the whole changelog again, as in the test above)."""
    table = make_table(tmp_path, "rocksdb://")
    table.apply_changelog_batch([changelog_event(table, 0, "s", record(9)),
                                 changelog_event(table, 1, "s", record(4))])
    await table.on_recovery_completed(set(), {TP(CHANGELOG, 0)})   # still a standby
    assert written(table) == []
    await table.on_recovery_completed({TP(CHANGELOG, 0)}, set())   # promoted
    assert written(table) == [(0, "s", record(9))]


async def test_a_partition_gone_is_forgotten_and_a_deleted_key_not_written(
        table: Any) -> None:
    table.apply_changelog_batch([changelog_event(table, 0, "s", record(9)),
                                 changelog_event(table, 1, "s", record(4)),
                                 changelog_event(table, 2, "u", record(3)),
                                 changelog_event(table, 3, "u", record(2)),
                                 changelog_event(table, 4, "u", None)])
    await table.on_recovery_completed({TP(CHANGELOG, 0)}, set())
    assert written(table) == [(0, "s", record(9))]   # "u" was deleted after its late record
    table.apply_changelog_batch([changelog_event(table, 5, "s", record(8))])
    await table.on_recovery_completed(set(), set())   # the partition went elsewhere
    await table.on_recovery_completed({TP(CHANGELOG, 0)}, set())
    assert written(table) == []
