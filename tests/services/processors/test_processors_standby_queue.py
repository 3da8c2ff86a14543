"""Standby records fetched when a recovery ends are not dropped (the rocksdb kill -9 test's
"worker never reached seq" under load).

faust's recovery starts the standby reads, awaits the stream partitions' seek, and then
resumes its flow control, which clears the changelog queue: the standby records fetched in
between and not read yet were dropped, while the reader moved the partition's offset past
them with the next record. On ``rocksdb://`` that offset is stored with the data, so a
promotion of the standby recovered only what lay past it: the dropped record (in the failing
runs, a session's only ``sessions`` record) was missing for good
(:mod:`pipeline.adapters.faust.changelog_queue`).

These tests drive faust's own changelog reader (``Recovery._slurp_changelogs``) and RocksDB
store through that sequence exactly, without a broker: records put into the queue as the
consumer delivers them, the resume of ``on_recovery_completed``, then the flush faust does
when the partitions are revoked for the promotion.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import faust
import pytest
from faust.events import Event
from faust.tables.manager import TableManager
from faust.tables.recovery import Recovery
from faust.types.tuples import TP, ConsumerMessage
from mode.utils.queues import FlowControlEvent

from pipeline.adapters.faust.changelog_queue import ChangelogQueue, ChangelogTableManager
from pipeline.adapters.faust.tables import ChangelogTable
from pipeline.services.processors.session_state import session_record_older

GENERATION = 3
QUEUE_SIZE = 2   # the processors' stream buffer is 8: a full queue is common under load


def make_table(tmp_path: Path, manager: type[TableManager]) -> Any:
    app = faust.App("t-standby", broker="kafka://127.0.0.1:1", store="rocksdb://",
                    datadir=str(tmp_path), autodiscover=False, Table=ChangelogTable,
                    TableManager=manager, key_serializer="raw", value_serializer="raw",
                    stream_buffer_maxsize=QUEUE_SIZE)
    app.consumer_generation_id = GENERATION
    table = app.Table("sessions", default=None, partitions=1, key_type=str,
                      older=session_record_older)
    table.key_serializer = "raw"
    table.changelog_topic = table._new_changelog_topic()
    return table


def standby_record(table: Any, offset: int, key: str,
                   generation: int = GENERATION) -> Any:
    """A record of the table's changelog as the consumer delivers it to the queue."""
    tp = TP(table.changelog_topic.get_topic_name(), 0)
    value = {"next": offset + 1}
    raw = table.changelog_topic.prepare_value(value, table.value_serializer)[0]
    message = ConsumerMessage(tp.topic, 0, offset, 0.0, 0, [], key.encode(), raw, None, 0, 0,
                              tp, generation_id=generation)
    return Event(table.app, key, value, [], message)


@pytest.fixture
async def reader(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """faust's recovery reading partition 0 of the table as a standby (its reader started
    by :func:`deliver_then_resume`)."""
    table = make_table(tmp_path, request.param)
    recovery = table.app.tables.recovery
    tp = TP(table.changelog_topic.get_topic_name(), 0)
    recovery.tp_to_table[tp] = table
    recovery.standby_tps.add(tp)
    table.app.flow_control.resume()   # the recovery's resume when it starts the standbys
    tasks: list[asyncio.Future[Any]] = []
    yield SimpleNamespace(table=table, recovery=recovery, tp=tp, tasks=tasks,
                          queue=table.app.tables.changelog_queue)
    for task in tasks:
        task.cancel()


async def read_to(reader: Any, offset: int) -> None:
    """Until faust's reader has read the partition to ``offset`` (its standby offset)."""
    for _ in range(200):
        await asyncio.sleep(0)
        if reader.recovery.standby_offsets.get(reader.tp) == offset:
            return
    raise AssertionError(f"the reader stopped at {reader.recovery.standby_offsets}")


def promote(reader: Any) -> int | None:
    """faust's steps on the promotion: the revoke flushes the buffered standby records, the
    recovery then starts the active read past the store's offset."""
    reader.recovery.flush_buffers()
    offset: int | None = reader.table.persisted_offset(reader.tp)
    return offset


async def deliver_then_resume(reader: Any) -> None:
    """Records delivered while the stream seek is awaited and the reader has not run yet (a
    loaded machine; the last record fills the queue and waits for room), the resume of
    ``on_recovery_completed``, then the reader and the next record."""
    queue = reader.queue
    for offset, key in enumerate(["s-a", "s-b"]):
        queue.put_nowait(standby_record(reader.table, offset, key))
    waiting = asyncio.ensure_future(queue.put(standby_record(reader.table, 2, "s-c")))
    await asyncio.sleep(0)
    assert queue.full() and not waiting.done()
    reader.table.app.flow_control.resume()
    reader.tasks += [waiting, asyncio.ensure_future(
        Recovery._slurp_changelogs(reader.recovery))]
    await asyncio.wait([waiting])   # faust delivers one record after the other
    await queue.put(standby_record(reader.table, 3, "s-d"))
    await read_to(reader, 3)


@pytest.mark.parametrize("reader", [ChangelogTableManager], indirect=True)
async def test_a_resume_keeps_the_standby_records_fetched_before_it(reader: Any) -> None:
    await deliver_then_resume(reader)
    assert promote(reader) == 3
    assert {key: reader.table.get(key) for key in ("s-a", "s-b", "s-c", "s-d")} == {
        "s-a": {"next": 1}, "s-b": {"next": 2}, "s-c": {"next": 3}, "s-d": {"next": 4}}
    assert reader.queue.kept == 2


@pytest.mark.parametrize("reader", [TableManager], indirect=True)
async def test_faust_s_own_queue_loses_them_behind_the_stored_offset(reader: Any) -> None:
    """The defect as faust has it (the reproduction is faithful): the store's offset is past
    three records it does not hold, so a promotion never reads them."""
    await deliver_then_resume(reader)
    assert promote(reader) == 3
    assert [reader.table.get(key) for key in ("s-a", "s-b", "s-c")] == [None] * 3


def queue_of(generation: int = GENERATION) -> ChangelogQueue:
    app = SimpleNamespace(flow_control=FlowControlEvent(initially_suspended=False),
                          consumer_generation_id=generation)
    return ChangelogQueue(app, maxsize=QUEUE_SIZE)


def record(offset: int, generation: int = GENERATION) -> Any:
    tp = TP("t-changelog", 0)
    return SimpleNamespace(message=ConsumerMessage(tp.topic, 0, offset, 0.0, 0, [], b"k", b"v",
                                                   None, 0, 0, tp, generation_id=generation))


async def test_a_rebalance_clears_everything_as_faust_does() -> None:
    """faust suspends the flow, then clears: the recovery seeks every changelog partition to
    the offset it has read to, so the records are fetched again."""
    queue = queue_of()
    queue.put_nowait(record(0))
    queue.put_nowait(record(1))
    waiting = asyncio.ensure_future(queue.put(record(2)))
    await asyncio.sleep(0)
    queue.app.flow_control.suspend()
    queue.app.flow_control.clear()
    await asyncio.sleep(0)
    assert queue.empty() and waiting.cancelled()


async def test_a_resume_drops_the_records_of_an_earlier_generation() -> None:
    queue = queue_of()
    queue.put_nowait(record(7, GENERATION - 1))
    queue.put_nowait(record(0))
    queue.app.flow_control.resume()
    assert [queue.get_nowait().message.offset] == [0] and queue.empty()


async def test_records_waiting_for_room_are_put_once_there_is_room() -> None:
    queue = queue_of()
    queue.put_nowait(record(0, GENERATION - 1))
    queue.put_nowait(record(1))
    waiting = [asyncio.ensure_future(queue.put(record(offset))) for offset in (2, 3)]
    await asyncio.sleep(0)
    queue.app.flow_control.resume()   # room for one: the other waits again
    await asyncio.sleep(0)
    assert [w.done() for w in waiting] == [True, False]
    assert [queue.get_nowait().message.offset for _ in range(2)] == [1, 2]
    await asyncio.sleep(0)
    assert waiting[1].done() and queue.get_nowait().message.offset == 3


def test_the_processors_app_uses_the_queue() -> None:
    from pipeline.services.processors.app import _new_app
    from pipeline.services.processors.options import ProcessorsOptions
    from pipeline.settings import Settings

    app = _new_app(Settings(), ProcessorsOptions())
    assert isinstance(app.tables.changelog_queue, ChangelogQueue)
