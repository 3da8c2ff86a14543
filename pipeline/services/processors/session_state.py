"""The state the session folds keep per session, and the fold of one event into it.

:class:`SessionState` is the value of the ``sessions`` table (one record per session, see
:mod:`.folding` and :mod:`pipeline.adapters.faust.pending`); :func:`plan_event` applies core's
pure folds to it.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any, Final

from pipeline.core.errors import EventError
from pipeline.core.events import SURFACE_TYPES, Event, JsonValue, dumps_json
from pipeline.core.fleet import FleetStatus
from pipeline.core.projection import MessageChange, slot_changes, with_session
from pipeline.core.surface import Replaced, SurfaceFold
from pipeline.core.tenants import TENANT_TYPE
from pipeline.core.usage import SessionUsage, UsageSample
from pipeline.core.validation import projected_message

# What the usage fold reads: the calls, the model of the request header and the session's
# tenant (kept in the ``usage`` part of the session's record: a restart keeps it).
USAGE_TYPES: Final = frozenset({"assistant/message", "request/header", TENANT_TYPE})
# What a session's table record and its Kafka key take beyond its surface and its strings
# (field names, numbers, brackets): ~800 bytes; the bound below only has to be an upper one.
RECORD_FIXED_BYTES: Final = 2_048
JSON_BYTES_PER_CHAR: Final = 6   # the worst case of a character in JSON: \uXXXX
NODE_RESULT_BYTES: Final = 27    # a surface node's result digest in JSON (24 hex digits)
# An event's message as JSON is at most this many times the event's Avro bytes (a field's
# name is in the JSON only: a few characters against at least one byte in Avro).
MESSAGE_BYTES_PER_EVENT_BYTE: Final = 24

Table = MutableMapping[str, Any]


@dataclass(frozen=True, slots=True)
class SessionTables:
    """Co-partitioned tables (``sessions`` and ``chunk_marks`` by session, ``nodes`` by
    ``<session>/<seq>``)."""

    sessions: Table
    nodes: Table
    chunk_marks: Table


@dataclass(slots=True)
class SessionState:
    """Everything the folds of one session need: the value of the ``sessions`` table."""

    session_id: str
    next_seq: int = 0
    partition: int = -1
    # Core's surface fold without messages (they are in the ``nodes`` table): live nodes only.
    surface: SurfaceFold = field(default_factory=lambda: SurfaceFold(keep_messages=False))
    usage: SessionUsage = field(default_factory=SessionUsage)
    fleet: FleetStatus | None = None
    stalled: bool = False  # a gap or an invalid event was reported and not yet filled
    first_offset: int = 0   # of the session's first event: where ``?at_seq=`` reads from

    def to_json(self) -> dict[str, JsonValue]:
        """A fresh value: faust serialises table values later, so nothing may be shared
        with this (cached, still changing) state. Its size is bounded by the live surface:
        nothing in it grows with the number of events."""
        fleet = self.fleet or FleetStatus(self.session_id)
        return {"next": self.next_seq, "partition": self.partition,
                "surface": self.surface.to_json(), "usage": self.usage.to_json(),
                "fleet": fleet.to_json(), "stalled": self.stalled,
                "first": self.first_offset}

    @classmethod
    def from_json(cls, session_id: str, raw: JsonValue) -> SessionState:
        if raw is None:
            return cls(session_id, fleet=FleetStatus(session_id))
        return cls(session_id, int(raw["next"]), int(raw["partition"]),
                   SurfaceFold.from_json(raw["surface"]), SessionUsage.from_json(raw["usage"]),
                   FleetStatus.from_json(raw["fleet"]), bool(raw.get("stalled", False)),
                   int(raw.get("first") or 0))


def record_bytes_bound(state: SessionState, event_seq: int, strings_chars: int) -> int:
    """An upper bound of the size of the session's table record (JSON) once the event at
    ``event_seq`` is folded into ``state``, when the strings the record keeps (see
    :func:`kept_chars`) take at most ``strings_chars`` characters then.

    From counts, not by serialising the record (O(session) per event): the record keeps
    the live surface nodes only (an event adds at most one), each two seqs and, for a
    tool result, a digest.
    """
    digits = len(str(max(event_seq, state.next_seq, 1)))
    surface = (len(state.surface) + 1) * (2 * digits + NODE_RESULT_BYTES + 6)
    return (surface + JSON_BYTES_PER_CHAR * (len(state.session_id) + strings_chars)
            + RECORD_FIXED_BYTES)


def kept_chars(usage: SessionUsage, fleet: FleetStatus | None) -> int:
    """Characters of the strings a session's record keeps from its events (a model, a
    tenant, an end reason, an error)."""
    kept = [*(usage.last_model or ()), usage.tenant]
    if fleet is not None:
        kept += [fleet.state, fleet.last_end_reason or "", fleet.last_error or ""]
    return sum(len(text) for text in kept)


def kept_chars_after(state: SessionState, event: Event) -> int:
    """:func:`kept_chars` once ``event`` is folded, from a trial fold of copies."""
    usage = SessionUsage(state.usage.totals, state.usage.last_model, state.usage.tenant)
    if event.type in USAGE_TYPES:
        with suppress(EventError):   # the fold itself refuses the event
            usage.apply(state.session_id, event)
    fleet = replace(state.fleet or FleetStatus(state.session_id))
    fleet.apply(event)
    return kept_chars(usage, fleet)


def session_record_older(held: Any, incoming: Any) -> bool:
    """Whether a ``sessions`` record is older than the one held: it expects an earlier seq
    (a session's record only moves forward; two records of one seq are equal folds)."""
    return int(incoming["next"]) < int(held["next"])


def chunk_mark_older(held: Any, incoming: Any) -> bool:
    """Whether a ``chunk_marks`` cursor is behind the one held."""
    return int(incoming) < int(held)


def next_expected(tables: SessionTables, session_id: str) -> int:
    """The seq the session's next record must carry (0 for an unknown session)."""
    state = tables.sessions.get(session_id)
    return max(int(state["next"]) if state else 0, int(tables.chunk_marks.get(session_id) or 0))


@dataclass(slots=True)
class FoldPlan:
    """What one event changed (the state itself is updated in place)."""

    message: Any = None
    changes: list[MessageChange] = field(default_factory=list)
    removed: tuple[int, ...] = ()   # seqs of the nodes a replace took off the surface
    sample: UsageSample | None = None
    fleet_changed: bool = False


def plan_event(state: SessionState, event: Event) -> FoldPlan:
    """Fold ``event`` into ``state``; raises EventError having changed nothing."""
    plan = FoldPlan()
    totals, last_model, tenant = (state.usage.totals, state.usage.last_model,
                                  state.usage.tenant)
    try:
        if event.type in USAGE_TYPES:
            plan.sample = state.usage.apply(state.session_id, event)
        if event.type in SURFACE_TYPES and event.surface_op is not None:
            # core's fold refuses a bad event (every surface rule) before it changes anything
            change = state.surface.apply(event)
            plan.message = change.message if change is not None else None
            plan.removed = change.removed_seqs if isinstance(change, Replaced) else ()
            plan.changes = with_session(slot_changes(change), state.session_id)
    except EventError:
        state.usage.totals, state.usage.last_model, state.usage.tenant = (totals, last_model,
                                                                          tenant)
        raise
    fleet = state.fleet or FleetStatus(state.session_id)
    plan.fleet_changed = fleet.apply(event)
    state.fleet = fleet
    return plan


def refuse_oversize(state: SessionState, event: Event, event_bytes: int, limit: int) -> None:
    """Raise :class:`EventError` for an event after which the session's table record, or
    its message's ``nodes`` record, might exceed ``limit`` (the producer's record limit):
    the session stops there, dead-lettered, as at an invalid event. Written anyway, that
    record would be refused at the next commit, and a refused table write stops every later
    one of the worker (faust's producer buffer dies with it)."""
    advice = ("the session stops here (a larger producer max request size, and max.message"
              ".bytes on the changelog topics, lets it go on)")
    # The event's strings replace some of those kept: it bounds what they can add.
    bound = record_bytes_bound(state, event.seq,
                               kept_chars(state.usage, state.fleet) + event_bytes)
    if bound > limit:   # a large event or session: what it really keeps, then
        bound = record_bytes_bound(state, event.seq, kept_chars_after(state, event))
    if bound > limit:
        raise EventError(f"folded, it could make the session's table record {bound:,} "
                         f"bytes, above the {limit:,}-byte record limit of the producer; "
                         f"{advice}", seq=event.seq, type=event.type,
                         rule="session-record-size")
    if event.type not in SURFACE_TYPES or MESSAGE_BYTES_PER_EVENT_BYTE * event_bytes + \
            RECORD_FIXED_BYTES <= limit:
        return   # its message cannot be that large: not worth serialising it
    size = len(dumps_json(projected_message(event)).encode()) + RECORD_FIXED_BYTES
    if size > limit:
        raise EventError(f"its message takes {size:,} bytes as a table record, above "
                         f"the {limit:,}-byte record limit of the producer; {advice}",
                         seq=event.seq, type=event.type, rule="message-record-size")
