"""The processors' compacted outputs folded into their current values (synchronous).

:class:`OutputView` keeps the last value per key of one output topic (``fleet``: key session
id, ``usage``: ``session/<id>``, ``model/...``, ``window/...``), decoded by an
:class:`~pipeline.codec.outputs.OutputDecoder`; :class:`DerivedView` keeps the derived
messages of every session (keys ``<session>/<slot>``). Applying a record returns the
:class:`OutputChange` it made. A record that does not decode, whose schema is not the
topic's, or whose key is unreadable is counted in ``undecodable`` (the last few described
in ``problems``) and changes nothing: never fatal.

Each value comes with its source position (``dsh.source.*`` headers,
:func:`~pipeline.codec.records.source_position`), kept per key in ``sources``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final

from pipeline.codec.outputs import (
    DERIVED_MESSAGE_CHANGE,
    FLEET_STATUS,
    USAGE_RECORD,
    OutputDecoder,
)
from pipeline.codec.records import ConsumedRecord, SourcePosition, source_position
from pipeline.core.errors import DshError
from pipeline.core.events import JsonValue
from pipeline.core.projection import parse_slot_key

PROBLEMS_KEPT: Final = 20
KINDS: Final = {"fleet": FLEET_STATUS, "usage": USAGE_RECORD,
                "derived": DERIVED_MESSAGE_CHANGE}


@dataclass(frozen=True, slots=True)
class OutputChange:
    """One applied record: ``value`` None when the key was deleted (a tombstone)."""

    topic: str
    partition: int
    offset: int
    key: str
    value: dict[str, JsonValue] | None
    source: SourcePosition | None


@dataclass(slots=True)
class OutputView:
    """The last value per key of one output topic (see the module doc)."""

    decoder: OutputDecoder
    schema: str
    values: dict[str, dict[str, JsonValue]] = field(default_factory=dict)
    sources: dict[str, SourcePosition] = field(default_factory=dict)
    records: int = 0
    undecodable: int = 0
    problems: deque[str] = field(default_factory=lambda: deque(maxlen=PROBLEMS_KEPT))

    def apply(self, record: ConsumedRecord) -> OutputChange | None:
        """Fold one record; the change it made, or None when it was skipped (counted)."""
        self.records += 1
        try:
            key = record.key.decode("utf-8") if record.key is not None else None
            if not key:
                raise DshError("a record without a key")
            value = self.decoder.decode(record.value, self.schema)
            self._check(key, value)
        except (DshError, UnicodeDecodeError) as exc:
            self.undecodable += 1
            self.problems.append(f"{record.topic}[{record.partition}]@{record.offset}: "
                                 f"skipped: {str(exc)[:200]}")
            return None
        source = source_position(record.headers)
        self._set(key, value, source)
        return OutputChange(record.topic, record.partition, record.offset, key, value, source)

    def _check(self, key: str, value: dict[str, JsonValue] | None) -> None:
        """Raise for a key this view cannot hold (the derived view checks slot keys)."""

    def _set(self, key: str, value: dict[str, JsonValue] | None,
             source: SourcePosition | None) -> None:
        if value is None:
            self.values.pop(key, None)
            self.sources.pop(key, None)
            return
        self.values[key] = value
        if source is not None:
            self.sources[key] = source


@dataclass(frozen=True, slots=True)
class Conversation:
    """One session's derived messages: the live slots in order, and what they cover."""

    session_id: str
    messages: tuple[JsonValue, ...]
    seqs: tuple[int, ...]          # the event seq of each message
    at_seq: int                    # the last change seq folded in (-1: none)
    source: SourcePosition | None  # the session-topic position of that change, if known


class DerivedView(OutputView):
    """The derived messages of every session, by slot (``<session>/<slot>`` keys)."""

    def __init__(self, decoder: OutputDecoder) -> None:
        super().__init__(decoder, DERIVED_MESSAGE_CHANGE)
        self.sessions: dict[str, dict[int, str]] = {}  # session -> slot -> key
        # session -> the latest source position of any of its records (tombstones too: a
        # replace's tombstones come from the same event as its kept slot)
        self.positions: dict[str, SourcePosition] = {}

    def _check(self, key: str, value: dict[str, JsonValue] | None) -> None:
        parse_slot_key(key)

    def _set(self, key: str, value: dict[str, JsonValue] | None,
             source: SourcePosition | None) -> None:
        session_id, slot = parse_slot_key(key)
        slots = self.sessions.setdefault(session_id, {})
        if value is None:
            slots.pop(slot, None)
        else:
            slots[slot] = key
        known = self.positions.get(session_id)
        if source is not None and (known is None or source > known):
            self.positions[session_id] = source
        super()._set(key, value, source)

    def conversation(self, session_id: str) -> Conversation:
        slots = self.sessions.get(session_id, {})
        messages: list[JsonValue] = []
        seqs: list[int] = []
        at_seq = -1
        for slot in sorted(slots):
            value = self.values[slots[slot]]
            change_seq = value.get("changeSeq")
            if isinstance(change_seq, int):
                at_seq = max(at_seq, change_seq)
            if value.get("message") is not None:
                messages.append(value["message"])
                seq = value.get("seq")
                seqs.append(seq if isinstance(seq, int) else -1)
        return Conversation(session_id, tuple(messages), tuple(seqs), at_seq,
                            self.positions.get(session_id))

    def conversations(self) -> dict[str, list[JsonValue]]:
        """Session id -> derived messages (every session seen, as a compacted-topic
        consumer rebuilds them: :func:`pipeline.core.projection.rebuild_conversations`)."""
        return {sid: list(self.conversation(sid).messages) for sid in self.sessions}
