"""Session checkpoints: their record form, their loading, and the one-time migration.

Rules kept here (docs/driver-state.md):

- A checkpoint is the fold of exactly the events committed with it (the sink folds what it
  buffers and writes the fold in the same transaction), so a session loads from its latest
  checkpoint alone: no session-topic record is read for it.
- A checkpoint above the record limit is written as a *pointer* (``{"tooLarge": true}``):
  its session loads by reading its events from the session partition instead (slow, never
  wrong). The live surface would have to be above ``DSH_MAX_RECORD_BYTES`` (8 MiB default).
- A partition of a topic written by older code has no checkpoints: the first owner reads the
  session partition whole once, writes every session's checkpoint and then the partition's
  migrated mark (:data:`~pipeline.adapters.kafka.checkpoints.MIGRATED_KEY`), and no owner
  reads it whole again.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Final

from pipeline.adapters.kafka.checkpoints import (
    CheckpointEntry,
    CheckpointLoader,
    CheckpointScan,
    checkpoint_record,
    migrated_record,
    scan_checkpoints,
)
from pipeline.adapters.kafka.records import OutRecord, header_value
from pipeline.adapters.kafka.session_reader import (
    Decoder,
    committed_end,
    read_committed,
)
from pipeline.adapters.kafka.settled_ends import SETTLE_BUDGET_S
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.codec.records import HEADER_WRITER
from pipeline.core.checkpoint import SessionCheckpoint
from pipeline.core.errors import CodecError, EventError
from pipeline.core.events import Event, dumps_json
from pipeline.core.log import Mode, SessionLog
from pipeline.services.driver.checkpoint_tail import SessionTail
from pipeline.settings import Settings

log = logging.getLogger(__name__)

# The writer mark of a session whose log does not rebuild: ``invalid-log: <why>``.
INVALID_LOG: Final = "invalid-log"


def invalid_log_mark(error: EventError) -> str:
    return f"{INVALID_LOG}: its log on the session topic does not rebuild: {error}"


def invalid_log_reason(writer: str) -> str | None:
    """Why a session marked :func:`invalid_log_mark` is not driven (None: another mark)."""
    return writer[len(INVALID_LOG) + 2:] if writer.startswith(f"{INVALID_LOG}: ") else None
MIGRATION_BATCH: Final = 500  # checkpoints per migration transaction
_MARGIN: Final = 64 * 1024  # key and headers of a checkpoint fit in this


def checkpoint_value(checkpoint: SessionCheckpoint, max_record_bytes: int) -> bytes:
    """The record value of ``checkpoint``: the whole fold, or a pointer when too large."""
    value = dumps_json(checkpoint.to_json()).encode("utf-8")
    if len(value) <= max_record_bytes - _MARGIN:
        return value
    log.warning("session %s: its checkpoint (%d bytes) is above the record limit; a pointer "
                "is written, and the session loads from the session topic",
                checkpoint.session_id, len(value))
    return json.dumps({"v": 1, "session": checkpoint.session_id,
                       "nextSeq": checkpoint.next_seq, "tooLarge": True}).encode()


def record_of(topic: str, partition: int, checkpoint: SessionCheckpoint,
              max_record_bytes: int) -> OutRecord:
    return checkpoint_record(topic, partition, checkpoint.session_id,
                             checkpoint_value(checkpoint, max_record_bytes),
                             next_seq=checkpoint.next_seq, busy=checkpoint.busy,
                             writer=checkpoint.writer)


def decode_checkpoint(value: bytes) -> SessionCheckpoint | None:
    """The checkpoint of a record value; None for a pointer (load from the session topic).
    Raises :class:`CodecError` for a value that is neither."""
    try:
        raw = json.loads(value)
    except ValueError as exc:
        raise CodecError(f"a driver checkpoint is not JSON: {exc}") from None
    if isinstance(raw, dict) and raw.get("tooLarge") is True:
        return None
    return SessionCheckpoint.from_json(raw)


class CheckpointStore:
    """Loads sessions' checkpoints for one driver (every partition it owns)."""

    def __init__(self, settings: Settings, decode_event: Decoder, *, mode: Mode) -> None:
        self._settings = settings
        self._decode_event = decode_event
        self._mode = mode
        self._loader = CheckpointLoader(settings)
        self.session_records_read = 0  # session-topic records read: migrations, too large
        self.checkpoint_records_read = 0  # by takeovers' scans (loads read one each)
        self.tail_records_read = 0  # session-topic records of takeovers' tails

    async def scan(self, partition: int, tail: SessionTail | None = None) -> CheckpointScan:
        """The partition's index; values of the busy sessions (loaded at takeover) and of
        those with newer events in ``tail``."""
        def keep(session_id: str, entry: CheckpointEntry) -> bool:
            return entry.busy or (tail is not None and tail.newer(session_id, entry))

        scan = await scan_checkpoints(self._settings, partition, keep=keep,
                                      settle_s=SETTLE_BUDGET_S)
        self.checkpoint_records_read += scan.records
        return scan

    async def read_tail(self, partition: int, start: int | None) -> SessionTail:
        """The session partition from ``start`` (a tail mark) to its end; None: no tail to
        read, only where the partition ends (the first transactions' tail mark starts there)."""
        topic, what = self._settings.topics.session_events, f"session partition {partition}"
        if start is None:
            end = await committed_end(self._settings, topic, partition, what=f"end of {what}",
                                      settle_s=SETTLE_BUDGET_S)
            return SessionTail(self._decode_event, end)
        tail = SessionTail(self._decode_event, start)
        tail.end = await read_committed(self._settings, topic, partition, tail.visit,
                                        start_offset=start, what=f"read the tail of {what}",
                                        settle_s=SETTLE_BUDGET_S)
        self.tail_records_read += tail.records
        return tail

    async def load(self, partition: int, session_id: str, entry: CheckpointEntry
                   ) -> SessionCheckpoint:
        """An evicted session's checkpoint: one record read at its offset."""
        value = await self._loader.load(partition, entry.offset, session_id)
        if value is None:  # not where the index said: read the partition's latest
            scan = await scan_checkpoints(self._settings, partition,
                                          keep=lambda sid, _entry: sid == session_id)
            value = scan.values.get(session_id)
            if value is None:
                return SessionCheckpoint(session_id)
        checkpoint = decode_checkpoint(value)
        if checkpoint is None:
            return await self.from_session_topic(partition, session_id)
        return checkpoint

    async def from_session_topic(self, partition: int, session_id: str) -> SessionCheckpoint:
        """The slow path of a too-large checkpoint: the session's events, folded as the
        migration folds them (only this session's records are decoded)."""
        fold = MigrationFold(self._decode_event, self._mode, only=session_id)
        await read_committed(self._settings, self._settings.topics.session_events, partition,
                             fold.visit, what=f"read session {session_id!r} back")
        self.session_records_read += fold.records
        return fold.checkpoints.get(session_id) or SessionCheckpoint(session_id)

    async def migrate(self, producer: PartitionProducer, partition: int) -> CheckpointScan:
        """Checkpoint every session of a partition without them, then mark it migrated.

        The session partition is read once, record by record, into one checkpoint (and one
        bounded, validating log) per session: memory is bounded by the sessions' live
        surfaces, not by the partition's events."""
        settings = self._settings
        fold = MigrationFold(self._decode_event, self._mode)
        end = await read_committed(settings, settings.topics.session_events, partition,
                                   fold.visit, what=f"migrate session partition {partition}",
                                   settle_s=SETTLE_BUDGET_S)
        self.session_records_read += fold.records
        checkpoints = list(fold.checkpoints.values())
        scan = CheckpointScan(partition, migrated=True, records=fold.records)
        topic = settings.topics.driver_checkpoints
        for start in range(0, len(checkpoints), MIGRATION_BATCH):
            batch = checkpoints[start:start + MIGRATION_BATCH]
            records = [record_of(topic, partition, c, settings.max_record_bytes) for c in batch]
            offsets = await producer.commit(records)
            for checkpoint, record, offset in zip(batch, records, offsets, strict=True):
                scan.entries[checkpoint.session_id] = CheckpointEntry(
                    offset, checkpoint.next_seq, checkpoint.busy, checkpoint.writer)
                if checkpoint.busy and record.value is not None:
                    scan.values[checkpoint.session_id] = record.value
        await producer.commit([migrated_record(topic, partition, end)])
        log.info("session topic partition %d migrated: %d sessions checkpointed from %d "
                 "records (read once; never again)", partition, len(checkpoints), fold.records)
        return scan

    async def close(self) -> None:
        await self._loader.close()


class MigrationFold:
    """A session partition folded record by record into one checkpoint per session.

    Each session's events are also appended to a bounded log under the driver's validation
    mode: a session whose log does not rebuild (a gap, a duplicate, an undecodable record in
    it, a broken rule) is marked :data:`INVALID_LOG` and not driven, as a full rebuild would
    have found it."""

    def __init__(self, decode: Decoder, mode: Mode, *, only: str | None = None) -> None:
        """``only``: fold that session alone (other keys are passed over undecoded)."""
        self._decode = decode
        self._mode = mode
        self._only = only.encode("utf-8") if only is not None else None
        self.checkpoints: dict[str, SessionCheckpoint] = {}
        self._logs: dict[str, SessionLog] = {}  # the sessions still folding
        self.records = 0

    def visit(self, record: Any) -> bool:
        self.records += 1
        if self._only is not None and record.key != self._only:
            return True
        if record.value is None:
            log.error("session topic %s[%d]@%d: null value (tombstone)", record.topic,
                      record.partition, record.offset)
            return True
        try:
            session_id, event = self._decode(record.value)
        except CodecError as exc:
            log.error("session topic %s[%d]@%d is undecodable: %s", record.topic,
                      record.partition, record.offset, exc)
            return True
        if event.seq == 0:
            writer = header_value(record.headers or (), HEADER_WRITER)
            if writer is not None:
                self._logs.pop(session_id, None)
                self.checkpoints[session_id] = SessionCheckpoint(
                    session_id, writer=writer.decode("utf-8", "replace"))
                return True
        self._fold(session_id, event)
        return True

    def _fold(self, session_id: str, event: Event) -> None:
        checkpoint = self.checkpoints.get(session_id)
        if checkpoint is None:
            checkpoint = self.checkpoints[session_id] = SessionCheckpoint(session_id)
            self._logs[session_id] = SessionLog(session_id, mode=self._mode, bounded=True)
        session_log = self._logs.get(session_id)
        if session_log is None:  # written elsewhere, or already found invalid
            return
        try:
            session_log.append(event)
            checkpoint.advance((event,))
        except EventError as exc:
            log.error("session %s: its log on the session topic does not rebuild (%s): it is "
                      "marked %r and not driven", session_id, exc, INVALID_LOG)
            del self._logs[session_id]
            self.checkpoints[session_id] = SessionCheckpoint(session_id,
                                                             writer=invalid_log_mark(exc))

