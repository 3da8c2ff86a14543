"""The derived conversation as a sequence of CHANGES, in a form that survives log compaction.

The processors publish the derived messages of every session to a compacted topic, one record
per surface change, so that one event costs O(size of the change) and a consumer rebuilds the
conversation from whatever compaction left.

**Representation: slots.** Each node on the surface sits in a *slot*, named by the seq of the
event that was first *appended* there. A replace ``{start, end}`` puts the new node in the slot
of ``start`` (the first removed node, whose slot is the smallest of the range because the range
is contiguous in surface order) and empties the slots of the other removed nodes. Hence:

* slot order is surface order (appends take ever larger seqs; replaces reuse a slot in place),
  so the conversation is the live slots sorted by slot number;
* a record keyed ``<session>/<slot, zero-padded>`` always carries the current occupant of that
  slot, and an emptied slot gets a tombstone (``None`` value): after compaction exactly the live
  nodes remain, which is the right final state, whatever order replaces came in.

Positions would not work as keys: a replace of k nodes shifts every later position by k-1,
which would cost O(surface length) records per replace.

A node whose projection is nothing (an ``assistant/message`` with empty content) still occupies
its slot (it may be a replace endpoint later); its record has ``"message": null``.

Everything here is pure, and slots are a VIEW of core's one surface fold
(:class:`pipeline.core.surface.SurfaceFold`, every rule checked): each of its nodes carries
its slot, and :func:`slot_changes` turns one of its changes into the records to publish.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pipeline.core.errors import EventError
from pipeline.core.events import Event, JsonValue
from pipeline.core.surface import Appended, SurfaceChange, SurfaceFold

SLOT_DIGITS: Final = 12
ChangeKind = Literal["append", "replace", "remove"]
# Where a version's records lie. "key": where the default partitioner puts the slot key (a
# reader of one session reads every partition). "session": in the partition of the session's
# own events (the same partition number of the session topic; both topics have one partition
# count), so a reader of one session reads one partition. A topic keeps one layout for its
# life: a record written elsewhere would survive compaction beside its key's newer value.
Layout = Literal["key", "session"]


def slot_key(session_id: str, slot: int) -> str:
    """The compacted-topic key of a slot: zero-padded so lexical order is surface order."""
    return f"{session_id}/{slot:0{SLOT_DIGITS}d}"


def parse_slot_key(key: str) -> tuple[str, int]:
    """Inverse of :func:`slot_key`; raises EventError naming the bad key."""
    session_id, sep, slot = key.rpartition("/")
    if not sep or not session_id or not slot.isdigit():
        raise EventError(f"derived-messages key {key[:120]!r} is not '<session>/<slot>'",
                         rule="derived-key-shape")
    return session_id, int(slot)


@dataclass(frozen=True, slots=True)
class MessageChange:
    """One record of the derived-messages topic (``remove`` is a tombstone)."""

    session_id: str
    slot: int
    seq: int
    change_seq: int
    kind: ChangeKind
    message: JsonValue | None

    @property
    def key(self) -> str:
        return slot_key(self.session_id, self.slot)

    def to_json(self) -> dict[str, JsonValue] | None:
        """The record value; None for a removal (a tombstone, so compaction drops the slot)."""
        if self.kind == "remove":
            return None
        return {"session": self.session_id, "slot": self.slot, "seq": self.seq,
                "changeSeq": self.change_seq, "op": self.kind, "message": self.message}


def slot_changes(change: SurfaceChange | None) -> list[MessageChange]:
    """The records one surface change publishes (session id not stamped yet, see
    :func:`with_session`): an append fills its own slot; a replace puts the new node in the
    first removed node's slot and empties the slots of the others."""
    if change is None:
        return []
    if isinstance(change, Appended):
        return [MessageChange("", change.seq, change.seq, change.seq, "append", change.message)]
    seq = change.seq
    slots = change.removed_slots or change.removed_seqs
    removed = list(zip(slots, change.removed_seqs, strict=True))
    changes = [MessageChange("", change.slot, seq, seq, "replace", change.message)]
    changes += [MessageChange("", slot, old, seq, "remove", None) for slot, old in removed[1:]]
    return changes


def fold_slots(fold: SurfaceFold, event: Event) -> list[MessageChange]:
    """Fold ``event`` into ``fold`` and return its slot changes (raises EventError having
    changed nothing)."""
    return slot_changes(fold.apply(event))


def with_session(changes: Iterable[MessageChange], session_id: str) -> list[MessageChange]:
    """The same changes stamped with their session id (the fold itself does not know it)."""
    return [MessageChange(session_id, c.slot, c.seq, c.change_seq, c.kind, c.message)
            for c in changes]


def rebuild_conversations(records: Iterable[tuple[str, JsonValue | None]]
                          ) -> dict[str, list[JsonValue]]:
    """What a consumer of the compacted topic does: key/value records (in topic order, values
    decoded, None for tombstones) -> derived messages per session."""
    live: dict[str, dict[int, JsonValue | None]] = {}
    for key, value in records:
        session_id, slot = parse_slot_key(key)
        slots = live.setdefault(session_id, {})
        if value is None:
            slots.pop(slot, None)
        else:
            slots[slot] = value.get("message") if isinstance(value, Mapping) else None
    return {sid: [m for _s, m in sorted(slots.items()) if m is not None]
            for sid, slots in live.items()}


# --- Projection versions: the pointer topic's records and the writers' routing rule ---------
#
# The compacted pointer topic ``<prefix>projection-versions`` holds, per projection:
#   "<projection>"                    the active version (readers and writers follow it)
#   "<projection>/handover"           a rebuilt version waiting for the live writers to hold
#   "<projection>/writer/<worker>"    a live writer (a processors worker) following the pointer
#   "<projection>/held/<worker>"      that worker holds (folds nothing) for a handover
#   "<projection>/layout/<topic>"     {"layout": "session"}: the topic's records lie in their
#                                     session's partition; written before its first record
#                                     (no such record: "key", the default partitioner's)
# The rules and why they are correct: pipeline.services.replay.versions.


@dataclass(frozen=True, slots=True)
class ActivePointer:
    """The version readers read and live writers write. ``covered``: per session-topic
    partition, the offset below which the rebuild wrote every change; a live writer folds the
    records below it without publishing (their changes are in the topic already) and
    publishes from it on. Empty for version 0 (the processors wrote it all)."""

    version: int
    topic: str
    events: int = 0
    covered: Mapping[int, int] = field(default_factory=dict)

    def to_json(self, projection: str) -> dict[str, JsonValue]:
        return {"projection": projection, "version": self.version, "topic": self.topic,
                "events": self.events,
                "covered": {str(p): o for p, o in sorted(self.covered.items())}}

    @classmethod
    def from_json(cls, raw: Mapping[str, JsonValue]) -> ActivePointer:
        covered = raw.get("covered") or {}
        if not isinstance(covered, Mapping):
            raise EventError(f"pointer 'covered' must be an object, got {covered!r}",
                             rule="pointer-shape")
        return cls(int(raw["version"]), str(raw["topic"]), int(raw.get("events") or 0),
                   {int(p): int(o) for p, o in covered.items()})


@dataclass(frozen=True, slots=True)
class HandoverRequest:
    """``replay`` asks the live writers to hold before version ``version`` becomes active;
    ``request`` is unique per request, so an answer left by an earlier one never counts."""

    version: int
    topic: str
    request: str

    def to_json(self) -> dict[str, JsonValue]:
        return {"version": self.version, "topic": self.topic, "request": self.request}

    @classmethod
    def from_json(cls, raw: Mapping[str, JsonValue]) -> HandoverRequest:
        return cls(int(raw["version"]), str(raw["topic"]), str(raw["request"]))


@dataclass(frozen=True, slots=True)
class HeldBy:
    """A live writer's answer: it folds nothing more until the request's version is active."""

    request: str
    partitions: frozenset[int]

    def to_json(self) -> dict[str, JsonValue]:
        return {"request": self.request, "partitions": sorted(self.partitions)}

    @classmethod
    def from_json(cls, raw: Mapping[str, JsonValue]) -> HeldBy:
        return cls(str(raw["request"]), frozenset(int(p) for p in raw["partitions"]))


@dataclass(slots=True)
class PointerState:
    """The pointer topic of one projection, folded from its records (in topic order)."""

    projection: str
    active: ActivePointer | None = None
    handover: HandoverRequest | None = None
    writers: dict[str, JsonValue] = field(default_factory=dict)
    held: dict[str, HeldBy] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)   # topic -> layout

    def apply(self, key: str, value: Mapping[str, JsonValue] | None) -> None:
        """Fold one record (``value`` None: a tombstone); keys of other projections are
        ignored, as are unknown sub-keys (a newer writer's additions)."""
        name, _sep, rest = key.partition("/")
        if name != self.projection:
            return
        kind, _sep, worker = rest.partition("/")
        if not rest:
            self.active = None if value is None else ActivePointer.from_json(value)
        elif kind == "handover" and not worker:
            self.handover = None if value is None else HandoverRequest.from_json(value)
        elif kind == "writer" and worker:
            _set_or_drop(self.writers, worker, None if value is None else dict(value))
        elif kind == "held" and worker:
            _set_or_drop(self.held, worker, None if value is None else HeldBy.from_json(value))
        elif kind == "layout" and worker:
            _set_or_drop(self.layouts, worker, None if value is None else _layout(value))

    def layout_of(self, topic: str) -> Layout:
        """Where ``topic``'s records lie (see :data:`Layout`)."""
        return self.layouts.get(topic, "key")

    def partition_of(self, topic: str, source_partition: int) -> int | None:
        """The partition of a change to ``topic`` whose event lies in ``source_partition`` of
        the session topic (None: the default partitioner's, by key)."""
        return source_partition if self.layout_of(topic) == "session" else None

    def pending(self) -> HandoverRequest | None:
        """The handover live writers must hold for (None: nothing pending)."""
        current = self.active.version if self.active is not None else 0
        if self.handover is not None and self.handover.version > current:
            return self.handover
        return None

    def held_partitions(self, request: str) -> set[int]:
        return {p for h in self.held.values() if h.request == request for p in h.partitions}


def _layout(value: Mapping[str, JsonValue]) -> Layout:
    found = value.get("layout")
    if found == "key":
        return "key"
    if found == "session":
        return "session"
    raise EventError(f"layout must be 'key' or 'session', got {found!r}", rule="pointer-shape")


def _set_or_drop(table: dict[str, Any], key: str, value: Any) -> None:
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


def publish_topic(active: ActivePointer, partition: int, offset: int) -> str | None:
    """Where a live writer publishes the changes of the record at ``partition``/``offset``:
    the active version's topic, or None below what the rebuild covered (fold, publish
    nothing: that change is in the topic already, and publishing it again after later ones
    would leave an older value last)."""
    if offset < active.covered.get(partition, 0):
        return None
    return active.topic


def handover_key(projection: str) -> str:
    return f"{projection}/handover"


def writer_key(projection: str, worker: str) -> str:
    return f"{projection}/writer/{worker}"


def held_key(projection: str, worker: str) -> str:
    return f"{projection}/held/{worker}"


def layout_key(projection: str, topic: str) -> str:
    return f"{projection}/layout/{topic}"


def fold_pointer_records(projection: str, records: Iterable[tuple[bytes | None, bytes | None]],
                         *, onto: PointerState | None = None) -> PointerState:
    """The pointer state of ``projection`` from the topic's (key, value) records in order,
    folded onto a copy of ``onto`` when given (the state of the records before these: it
    is left as it is); a record that is not a JSON object is an EventError naming it (never
    skipped: a writer that misread the pointer could publish to the wrong version)."""
    state = PointerState(projection) if onto is None else copy.deepcopy(onto)
    for key, value in records:
        if key is None:
            continue
        try:
            text = key.decode("utf-8")
            parsed = None if value is None else json.loads(value)
            if parsed is not None and not isinstance(parsed, Mapping):
                raise ValueError("not a JSON object")
            state.apply(text, parsed)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise EventError(f"projection-versions record {key[:80]!r}: {value!r:.120}: "
                             f"{type(exc).__name__}: {exc}", rule="pointer-shape") from None
    return state
