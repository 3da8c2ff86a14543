"""The driver's checkpoint topic: one compacted record per session, co-partitioned.

Partition p of ``<prefix>driver-checkpoints`` holds, per session of partition p of the session
topic, what a driver needs to continue it (:class:`~pipeline.core.checkpoint.SessionCheckpoint`,
JSON), written in the same transaction as the events it covers. Its headers say what a
takeover needs to decide without parsing the value:

- ``dsh.ckpt.seq``: the session's next seq (decimal);
- ``dsh.ckpt.busy``: ``1`` when a turn is open or the inbox lists hold waking work (the
  takeover loads the session and repairs or continues it), ``0`` when it is idle;
- ``dsh.writer``: another writer's mark (``import``/``ship``): the driver never drives it.

A record keyed :data:`MIGRATED_KEY` marks the partition as migrated: every session written
before it has a checkpoint (``dsh-pipeline`` writes it once, after the one full read of the
session partition a topic written by older code needs; docs/driver-state.md).

:func:`scan_checkpoints` reads a partition into an index (session -> offset and flags; values
kept only for the sessions a caller asks for); :class:`CheckpointLoader` reads one record at
a known offset, for an evicted session's next command.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from pipeline.adapters.kafka.errors import broker_errors, quietly
from pipeline.adapters.kafka.options import client_options, consumer_size_options
from pipeline.adapters.kafka.records import OutRecord, header_value
from pipeline.adapters.kafka.session_reader import read_committed
from pipeline.codec.records import HEADER_WRITER
from pipeline.core.checkpoint import SessionCheckpoint
from pipeline.core.events import dumps_json
from pipeline.settings import Settings

MIGRATED_KEY: Final = b"\x00migrated"
HEADER_SEQ: Final = "dsh.ckpt.seq"
HEADER_BUSY: Final = "dsh.ckpt.busy"
# A takeover's read holds this much of a checkpoint partition at a time (values are mostly
# read to be dropped: only the busy sessions' are kept).
SCAN_FETCH_BYTES: Final = 1024 * 1024
SCAN_BATCH: Final = 200

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CheckpointEntry:
    """Where a session's latest checkpoint is, and what its headers say."""

    offset: int
    next_seq: int
    busy: bool
    writer: str | None = None


@dataclass(slots=True)
class CheckpointScan:
    """One checkpoint partition read to its end."""

    partition: int
    entries: dict[str, CheckpointEntry] = field(default_factory=dict)
    values: dict[str, bytes] = field(default_factory=dict)  # of the sessions asked for
    migrated: bool = False
    records: int = 0
    end_offset: int = 0


def checkpoint_record(topic: str, partition: int | None, session_id: str, value: bytes, *,
                      next_seq: int, busy: bool, writer: str | None = None) -> OutRecord:
    headers: list[tuple[str, bytes]] = [(HEADER_SEQ, str(next_seq).encode()),
                                               (HEADER_BUSY, b"1" if busy else b"0")]
    if writer is not None:
        headers.append((HEADER_WRITER, writer.encode("utf-8")))
    return OutRecord(topic, session_id.encode("utf-8"), value, tuple(headers), partition)


def writer_marks(records: Iterable[OutRecord], topic: str) -> list[OutRecord]:
    """The checkpoint records marking sessions another writer publishes (import, ship):
    one per seq-0 record carrying a writer mark, so a driver never drives them."""
    marks: list[OutRecord] = []
    for record in records:
        writer = header_value(record.headers, HEADER_WRITER)
        if not writer or record.key is None:
            continue
        checkpoint = SessionCheckpoint(record.key.decode("utf-8", "replace"),
                                       writer=writer.decode("utf-8", "replace"))
        marks.append(checkpoint_record(
            topic, record.partition, checkpoint.session_id,
            dumps_json(checkpoint.to_json()).encode("utf-8"), next_seq=0, busy=False,
            writer=checkpoint.writer))
    return marks


def migrated_record(topic: str, partition: int, session_topic_end: int) -> OutRecord:
    value = f'{{"sessionTopicEnd":{session_topic_end}}}'.encode()
    return OutRecord(topic, MIGRATED_KEY, value, (), partition)


def entry_of(headers: Sequence[tuple[str, bytes | None]], offset: int
             ) -> CheckpointEntry | None:
    """The index entry of a checkpoint record at ``offset`` with ``headers`` (None: not a
    checkpoint record)."""
    seq = header_value(headers, HEADER_SEQ)
    if seq is None or not seq.isdigit():
        return None
    writer = header_value(headers, HEADER_WRITER)
    return CheckpointEntry(offset, int(seq), header_value(headers, HEADER_BUSY) == b"1",
                           writer.decode("utf-8", "replace") if writer is not None else None)


async def scan_checkpoints(settings: Settings, partition: int, *,
                           keep: Callable[[str, CheckpointEntry], bool],
                           timeout_s: float = 120.0,
                           settle_s: float | None = None) -> CheckpointScan:
    """Read checkpoint partition ``partition`` up to its LSO; keep the values ``keep`` wants
    (``keep(session_id, entry)``).

    A tombstone removes its session; a later record of a key replaces the earlier one.
    ``settle_s``: see :func:`.session_reader.read_committed` (a takeover's scan).
    """
    scan = CheckpointScan(partition)

    def visit(record: Any) -> bool:
        scan.records += 1
        if record.key == MIGRATED_KEY:
            scan.migrated = True
            return True
        if record.key is None:
            return True
        session_id = record.key.decode("utf-8", "replace")
        entry = (entry_of(record.headers or (), record.offset) if record.value is not None
                 else None)
        scan.values.pop(session_id, None)
        if entry is None:
            scan.entries.pop(session_id, None)
            return True
        scan.entries[session_id] = entry
        if keep(session_id, entry):
            scan.values[session_id] = record.value
        return True

    scan.end_offset = await read_committed(
        settings, settings.topics.driver_checkpoints, partition, visit, timeout_s=timeout_s,
        what=f"read the driver checkpoints of partition {partition}", batch=SCAN_BATCH,
        fetch_bytes=SCAN_FETCH_BYTES, settle_s=settle_s)
    return scan


class CheckpointLoader:
    """Reads single checkpoint records by offset (an evicted session's wake-up).

    One consumer (no group, read committed) for every partition of the driver; loads are
    serialised, each a seek and one fetch.
    """

    def __init__(self, settings: Settings, *, timeout_s: float = 30.0) -> None:
        self._settings = settings
        self._topic = settings.topics.driver_checkpoints
        self._timeout_s = timeout_s
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        self._assigned: TopicPartition | None = None

    async def load(self, partition: int, offset: int, session_id: str) -> bytes | None:
        """The value of the checkpoint of ``session_id`` at ``offset``; None when the record
        there is not that session's (the caller then scans the partition)."""
        async with self._lock:
            with broker_errors(f"load the checkpoint of session {session_id!r}",
                               timeout_s=self._timeout_s):
                return await asyncio.wait_for(self._load(partition, offset, session_id),
                                              self._timeout_s)

    async def _load(self, partition: int, offset: int, session_id: str) -> bytes | None:
        consumer = await self._started()
        tp = TopicPartition(self._topic, partition)
        if self._assigned != tp:
            consumer.assign([tp])
            self._assigned = tp
        consumer.seek(tp, offset)
        while True:
            fetched = await consumer.getmany(tp, timeout_ms=1000, max_records=1)
            for record in fetched.get(tp, ()):
                if record.offset != offset or record.key != session_id.encode("utf-8"):
                    return None
                value: bytes | None = record.value
                return value
            if await consumer.position(tp) > offset:
                return None  # passed it: compacted away, or a transaction marker

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(**client_options(self._settings),
                                        **consumer_size_options(self._settings),
                                        group_id=None, enable_auto_commit=False,
                                        isolation_level="read_committed",
                                        auto_offset_reset="earliest")
            await consumer.start()
            self._consumer = consumer
        return self._consumer

    async def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with quietly("stop of the checkpoint loader", log):
                await consumer.stop()
