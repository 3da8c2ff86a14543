"""A takeover's tail: the session partition from the committed tail mark to its end.

Sessions are checkpointed at rest points (``checkpoint_plan.py``), so a session in the middle
of a turn may have committed events newer than its latest checkpoint. The transactions that
committed them also committed a tail mark at or below the first of them; the takeover reads
the session partition from there (a bounded tail, never offset 0), and folds each such
session's newer events onto its checkpoint before it repairs the open turn.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from pipeline.adapters.kafka.checkpoints import CheckpointEntry
from pipeline.adapters.kafka.records import header_value
from pipeline.adapters.kafka.session_reader import Decoder
from pipeline.codec.records import HEADER_WRITER
from pipeline.core.checkpoint import SessionCheckpoint
from pipeline.core.errors import CodecError
from pipeline.core.events import Event

log = logging.getLogger(__name__)


class SessionTail:
    """The events of a session partition's tail, by session (a bounded read)."""

    def __init__(self, decode: Decoder, start: int) -> None:
        self._decode = decode
        self.start = start
        self.end = start
        self.events: dict[str, list[Event]] = {}
        self.writers: set[str] = set()  # sessions whose seq 0 carries another writer's mark
        self.records = 0

    def visit(self, record: Any) -> bool:
        self.records += 1
        if record.value is None:
            return True
        try:
            session_id, event = self._decode(record.value)
        except CodecError as exc:  # the session's fold then stops at a gap: it fails alone
            log.error("session topic %s[%d]@%d is undecodable: %s", record.topic,
                      record.partition, record.offset, exc)
            return True
        if event.seq == 0 and header_value(record.headers or (), HEADER_WRITER) is not None:
            self.writers.add(session_id)
        self.events.setdefault(session_id, []).append(event)
        return True

    def newer(self, session_id: str, entry: CheckpointEntry | None) -> bool:
        """The tail holds events of the session newer than its checkpoint (``entry``; None:
        it has none), and the driver writes it."""
        events = self.events.get(session_id)
        if not events or session_id in self.writers:
            return False
        if entry is None:
            return True
        return entry.writer is None and events[-1].seq >= entry.next_seq

    def dirty(self, entries: Mapping[str, CheckpointEntry]) -> Iterator[str]:
        """The sessions whose checkpoints the tail's events must be folded onto."""
        return (s for s in self.events if self.newer(s, entries.get(s)))

    def advance(self, checkpoint: SessionCheckpoint) -> None:
        """Fold the session's tail events its checkpoint does not cover. Raises
        :class:`~pipeline.core.errors.EventError` (a gap: the session fails alone)."""
        events = self.events.get(checkpoint.session_id, [])
        checkpoint.advance(e for e in events if e.seq >= checkpoint.next_seq)
