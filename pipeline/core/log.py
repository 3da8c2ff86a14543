"""One session's log: validates each appended event and folds it incrementally.

:class:`SessionLog` is the one place the rules come together: seq contiguity, the event-local
rules of :mod:`pipeline.core.validation`, the surface rules of :mod:`pipeline.core.surface` and
the turn bookkeeping of :mod:`pipeline.core.turns`. ``append`` checks everything first and only
then changes state, so a refused event leaves no trace.

Cost per append is O(size of the event) plus O(1) for an append to the surface and
O(surface length) for a replace; nothing is recomputed over the whole log. The derived messages
are built lazily and cached until the surface changes. ``messages_at(seq)`` replays the
recorded surface changes up to ``seq`` from the nearest checkpoint (surface events only, at
most a few hundred, never the whole log) and caches the last answer.

A *bounded* log (``bounded=True``, or :meth:`SessionLog.resumed` from a session checkpoint,
:mod:`pipeline.core.checkpoint`) validates and folds exactly the same way but keeps only the
events of the open turn, from its ``turn/start`` (none while no turn is open) and no
surface-change history (so no ``messages_at``): its memory is the live surface plus the open
turn, never the whole log. That is all a driver reads back: crash repair and the approval
wait look only inside the open turn (:mod:`pipeline.core.repair`,
:mod:`pipeline.core.turn_approvals`). The one state that outlives a turn boundary, an
approval question logged between turns and never decided (no writer of ours logs one), is
not in those events: a :class:`~pipeline.core.turn_machine.TurnMachine` reads the waiting
question from its History, so it still waits; ``repair_closers`` called on a bounded log
directly would close it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from typing import Final, overload

from pipeline.core.errors import EventError, SequenceError
from pipeline.core.events import Event, JsonValue
from pipeline.core.rules import MODES, Mode
from pipeline.core.surface import (
    SurfaceChange,
    SurfaceFold,
    SurfaceNode,
    apply_changes,
    derive_from_nodes,
)
from pipeline.core.turns import TurnState
from pipeline.core.validation import validate_event

__all__ = ["Mode", "SessionLog", "derive_messages", "hold_open_turn"]

CHECKPOINT_EVERY: Final = 512  # surface changes between snapshots kept for messages_at


class EventsView(Sequence[Event]):
    """A read-only, O(1) view of the log's events (no copy per access)."""

    __slots__ = ("_events",)

    def __init__(self, events: list[Event]) -> None:
        self._events = events

    def __len__(self) -> int:
        return len(self._events)

    @overload
    def __getitem__(self, index: int) -> Event: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Event, ...]: ...

    def __getitem__(self, index: int | slice) -> Event | tuple[Event, ...]:
        if isinstance(index, slice):
            return tuple(self._events[index])
        return self._events[index]

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events)


class SessionLog:
    """One session's log: validates each appended event and folds it incrementally."""

    def __init__(self, session_id: str, *, mode: Mode = "strict", bounded: bool = False) -> None:
        if mode not in MODES:
            raise EventError(f"unknown validation mode {mode!r}", rule="mode")
        self.session_id = session_id
        self.mode: Mode = mode
        self.bounded = bounded
        self.turn: TurnState = TurnState()
        self._base_seq = 0  # seq of the first held event (bounded: earlier ones are dropped)
        self._events: list[Event] = []
        self._view = EventsView(self._events)
        self._surface = SurfaceFold()
        self._change_seqs: list[int] = []  # seq of each surface change, ascending
        self._changes: list[SurfaceChange] = []
        self._at_cache: tuple[int, tuple[JsonValue, ...]] | None = None
        self._checkpoints: dict[int, tuple[SurfaceNode, ...]] = {}

    @classmethod
    def from_events(cls, session_id: str, events: Iterable[Event], *,
                    mode: Mode = "strict") -> SessionLog:
        log = cls(session_id, mode=mode)
        log.extend(events)
        return log

    @classmethod
    def resumed(cls, session_id: str, *, next_seq: int, turn: TurnState,
                surface: SurfaceFold, events: Sequence[Event], mode: Mode = "strict"
                ) -> SessionLog:
        """A bounded log that goes on from a folded state: ``turn`` and ``surface`` as
        after event ``next_seq - 1``, ``events`` the open turn's (from its ``turn/start``,
        ending at ``next_seq - 1``; empty when no turn is open).

        The log takes ``surface`` over (pass a copy to keep using it); it must keep messages.
        Raises :class:`EventError` when the pieces do not fit together.
        """
        seqs = [event.seq for event in events]
        first = next_seq - len(events)
        if first < 0 or seqs != list(range(first, next_seq)):
            raise EventError(f"resumed log: the open turn's events must be seqs "
                             f"{first}..{next_seq - 1}, not {seqs[:3]}...", rule="resume-state")
        if turn.in_turn != bool(events) or (events and events[0].type != "turn/start"):
            raise EventError("resumed log: the events must be the open turn's, from its "
                             "turn/start (none when no turn is open)", rule="resume-state")
        if not surface.keeps_messages:
            raise EventError("resumed log: the surface must keep messages", rule="resume-state")
        log = cls(session_id, mode=mode, bounded=True)
        log.turn, log._surface, log._base_seq = turn, surface, first
        log._events.extend(events)
        return log

    @property
    def next_seq(self) -> int:
        """The seq the next event must carry."""
        return self._base_seq + len(self._events)

    @property
    def events(self) -> Sequence[Event]:
        """Every event; for a bounded log, only the open turn's (see the module)."""
        return self._view

    def append(self, event: Event) -> SurfaceChange | None:
        """Validate and fold ``event``; returns what it changed on the surface (or None).

        Raises :class:`SequenceError` / :class:`EventError`; on error nothing changes.
        """
        expected = self.next_seq
        if event.seq != expected:
            raise SequenceError(expected=expected, found=event.seq, type=event.type)
        validate_event(event, mode=self.mode)
        change = self._surface.plan(event)
        turn = self.turn.advance(event)
        # Commit: nothing below can fail.
        self._surface.commit(event, change)
        self.turn = turn
        if self.bounded:
            self._base_seq += hold_open_turn(self._events, event, turn)
            return change
        self._events.append(event)
        if change is not None:
            self._change_seqs.append(event.seq)
            self._changes.append(change)
        return change

    def extend(self, events: Iterable[Event]) -> None:
        for event in events:
            self.append(event)

    def messages(self) -> tuple[JsonValue, ...]:
        """The current derived messages (each the JSON object as it stands in its event)."""
        return self._surface.messages()

    def surface(self) -> tuple[SurfaceNode, ...]:
        """The live surface nodes in order (seq and projected message of each)."""
        return self._surface.nodes()

    def messages_at(self, seq: int) -> tuple[JsonValue, ...]:
        """The derived messages as of just after event ``seq`` (-1: before any event).

        Needs an unbounded log (a bounded one keeps no surface history: EventError).
        """
        if self.bounded:
            raise EventError(f"messages_at({seq}) needs an unbounded log: session "
                             f"{self.session_id!r} is bounded and keeps no surface history",
                             seq=seq, rule="unbounded-log")
        if seq < -1 or seq >= len(self._events):
            raise EventError(f"messages_at({seq}): the log holds seqs 0..{len(self._events) - 1}",
                             seq=seq, rule="seq-in-log")
        count = bisect_right(self._change_seqs, seq)
        if count == len(self._changes):
            return self.messages()
        if self._at_cache is not None and self._at_cache[0] == count:
            return self._at_cache[1]
        result = derive_from_nodes(self._nodes_after(count))
        self._at_cache = (count, result)
        return result

    def _nodes_after(self, count: int) -> list[SurfaceNode]:
        """The surface after the first ``count`` surface changes.

        Replays from the nearest checkpoint at or below ``count`` (one every
        ``CHECKPOINT_EVERY`` changes, kept as they are passed: the change list only grows, so
        they stay valid), hence at most ``CHECKPOINT_EVERY`` changes per call.
        """
        base = count - count % CHECKPOINT_EVERY
        while base and base not in self._checkpoints:
            base -= CHECKPOINT_EVERY
        nodes = list(self._checkpoints.get(base, ()))
        while base + CHECKPOINT_EVERY <= count:
            nodes = apply_changes(nodes, self._changes[base:base + CHECKPOINT_EVERY])
            base += CHECKPOINT_EVERY
            self._checkpoints[base] = tuple(nodes)
        return apply_changes(nodes, self._changes[base:count])


def hold_open_turn(held: list[Event], event: Event, turn: TurnState) -> int:
    """Keep ``held`` the events of the open turn once ``event`` is folded (``turn``: the
    state after it); returns how many events left ``held`` for good (``event`` included
    when it is not held).

    A ``turn/start`` that opens a turn (one :class:`TurnState` takes: its data is an object)
    starts ``held`` afresh; an event after which no turn is open (a ``turn/end``, or one
    between turns) empties it; any other event joins the open turn.
    """
    if turn.turn is None:
        dropped = len(held) + 1
        held.clear()
        return dropped
    if event.type == "turn/start" and isinstance(event.data, dict):
        dropped = len(held)
        held[:] = [event]
        return dropped
    held.append(event)
    return 0


def derive_messages(events: Iterable[Event], *, mode: Mode = "ingest") -> tuple[JsonValue, ...]:
    """The derived messages of a whole log (validated as it is folded)."""
    log = SessionLog("", mode=mode)
    log.extend(events)
    return log.messages()
