"""A session checkpoint: the bounded state a driver needs to continue one session.

A driver that owns many sessions must not keep every event of every one. A
:class:`SessionCheckpoint` folds a session's events into what continuing it takes, and nothing
more:

- ``nextSeq``, the turn bookkeeping (:class:`~pipeline.core.turns.TurnState`: the next step,
  the calls crash repair must close);
- the live surface with its messages (:class:`~pipeline.core.surface.SurfaceFold`: the next
  model request is derived from it, and the replace rules are checked against it);
- the :class:`~pipeline.core.turn_history.History` (last turn, header and configuration,
  inbox lists, the ids already taken, the approvals);
- the open turn's events (crash repair and the approval wait read only those).

So its size is the live surface plus the open turn plus the history's id sets, never the
number of events. The rules it keeps:

- **Equivalence.** Folding a log in pieces, with any number of trips through
  :meth:`SessionCheckpoint.to_json` / ``json`` / :meth:`SessionCheckpoint.from_json` in
  between, gives the same ``to_json`` as folding it in one go.
- **Restore.** :meth:`SessionCheckpoint.restore` gives a bounded
  :class:`~pipeline.core.log.SessionLog` and a History that continue exactly as a log holding
  every event would (same messages, turn state, next seq, repair closers and next effects of a
  :class:`~pipeline.core.turn_machine.TurnMachine` built over them), and that share no mutable
  state with the checkpoint.
- **Cheap fold.** :meth:`SessionCheckpoint.advance` takes events a validating log has
  accepted already: it checks seq contiguity (:class:`SequenceError`) and the surface rules the
  fold needs anyway, not the event-local rules again.

``writer`` marks a session another writer owns (a dsh file shipped by ``import``/``ship``):
the driver does not drive it, the checkpoint only says so (and still folds its events).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from pipeline.core.errors import CodecError, EventError, SequenceError
from pipeline.core.events import Event, JsonValue, event_from_json
from pipeline.core.fleet import CHUNK_TYPE
from pipeline.core.log import SessionLog, hold_open_turn
from pipeline.core.rules import Mode
from pipeline.core.surface import SurfaceFold
from pipeline.core.turn_history import History
from pipeline.core.turns import TurnState

__all__ = ["VERSION", "SessionCheckpoint"]

# v2: written at rest points only (checkpoint_plan.py), so a session's newest events may lie
# after its checkpoint, in the tail a takeover reads from the inbox commit's tail mark. The
# fields are v1's. A v1 reader (older drivers) refuses v2 loudly instead of driving a stale
# checkpoint; this reader takes both (a v1 checkpoint was written with every transaction).
VERSION: Final = 2
READABLE: Final = frozenset({1, 2})
_KEYS: Final = frozenset({"v", "session", "nextSeq", "writer", "turn", "surface", "history",
                          "openTurn"})


class SessionCheckpoint:
    """The bounded state a driver needs to continue one session, folded from its events."""

    __slots__ = ("_history", "_next_seq", "_open", "_surface", "_turn", "session_id", "writer")

    def __init__(self, session_id: str, *, writer: str | None = None) -> None:
        self.session_id = session_id
        self.writer = writer  # another writer's mark (e.g. "dsh-file"): not driven here
        self._next_seq = 0
        self._turn = TurnState()
        self._surface = SurfaceFold()
        self._history = History()
        self._open: list[Event] = []  # the open turn's events, from its turn/start

    @property
    def next_seq(self) -> int:
        """The seq the next event must carry."""
        return self._next_seq

    @property
    def turn(self) -> TurnState:
        return self._turn

    @property
    def busy(self) -> bool:
        """A turn is open, or the inbox lists hold work that wakes the session."""
        return self._turn.in_turn or self._history.inbox.wakes

    @property
    def approval_asked_at(self) -> int | None:
        """When the question the open turn waits on was asked (epoch ms), or None."""
        waiting = self._history.approvals.waiting
        return None if waiting is None else waiting.asked_at

    def messages(self) -> tuple[JsonValue, ...]:
        """The derived messages now."""
        return self._surface.messages()

    def advance(self, events: Iterable[Event]) -> None:
        """Fold ``events`` (in seq order, from :attr:`next_seq`, already validated).

        Raises :class:`SequenceError` at a gap or repeat and :class:`EventError` for a
        surface rule the fold cannot get past; the events before the bad one stay folded.
        """
        for event in events:
            if event.seq != self._next_seq:
                raise SequenceError(expected=self._next_seq, found=event.seq, type=event.type)
            if event.type != CHUNK_TYPE:  # most events: none of these three folds reads one
                self._surface.apply(event)  # plans (checks) before it changes anything
                self._turn = self._turn.advance(event)
                self._history.advance(event)
            hold_open_turn(self._open, event, self._turn)
            self._next_seq += 1

    def restore(self, *, mode: Mode = "strict") -> tuple[SessionLog, History]:
        """A fresh bounded log that goes on from here and a copy of the History (for
        ``TurnMachine(log, history=...)``); neither shares mutable state with this."""
        log = SessionLog.resumed(self.session_id, next_seq=self._next_seq, turn=self._turn,
                                 surface=self._surface.copy(), events=tuple(self._open),
                                 mode=mode)
        return log, History.from_json(self._history.to_json())

    def to_json(self) -> dict[str, JsonValue]:
        """The JSON form: plain data ``json.dumps`` takes as it is. It shares the events' and
        messages' JSON with the checkpoint (never edited: see :mod:`pipeline.core.events`)."""
        return {"v": VERSION, "session": self.session_id, "nextSeq": self._next_seq,
                "writer": self.writer, "turn": self._turn.to_json(),
                "surface": self._surface.to_json(with_messages=True),
                "history": self._history.to_json(),
                "openTurn": [event.to_json() for event in self._open]}

    @classmethod
    def from_json(cls, raw: JsonValue) -> SessionCheckpoint:
        """The checkpoint :meth:`to_json` gave; :class:`CodecError` for anything else (an
        unknown version, a missing or mistyped field, pieces that do not fit together)."""
        fields = _fields(raw)
        checkpoint = cls(fields["session"], writer=fields["writer"])
        checkpoint._next_seq = fields["nextSeq"]
        checkpoint._turn = TurnState.from_json(fields["turn"])
        checkpoint._surface = SurfaceFold.from_json(fields["surface"], keep_messages=True)
        checkpoint._history = History.from_json(fields["history"])
        checkpoint._open = _open_turn(fields["openTurn"])
        try:  # the checks a resumed log makes (the pieces must fit); the log is dropped
            SessionLog.resumed(checkpoint.session_id, next_seq=checkpoint._next_seq,
                               turn=checkpoint._turn, surface=checkpoint._surface,
                               events=checkpoint._open)
        except EventError as error:
            raise CodecError(f"session checkpoint {fields['session']!r}: {error}") from None
        return checkpoint


def _fields(raw: JsonValue) -> Mapping[str, JsonValue]:
    """The top-level fields, their types checked."""
    if not isinstance(raw, Mapping):
        raise CodecError("a session checkpoint must be a JSON object")
    if type(raw.get("v")) is not int or raw.get("v") not in READABLE:
        raise CodecError(f"unknown session checkpoint version {raw.get('v')!r} (this reader "
                         f"knows v {sorted(READABLE)})")
    if set(raw) != _KEYS:
        raise CodecError(f"a session checkpoint has exactly the fields {sorted(_KEYS)}; "
                         f"got {sorted(raw)}")
    writer, next_seq = raw["writer"], raw["nextSeq"]
    if not isinstance(raw["session"], str) or not (writer is None or isinstance(writer, str)) \
            or type(next_seq) is not int or next_seq < 0 \
            or not isinstance(raw["openTurn"], list):
        raise CodecError("a session checkpoint needs a string session, a string or null "
                         "writer, a non-negative integer nextSeq and an openTurn list")
    return raw


def _open_turn(raw: list[JsonValue]) -> list[Event]:
    try:
        return [event_from_json(item) for item in raw]
    except EventError as error:
        raise CodecError(f"a session checkpoint's openTurn holds a bad event: {error}") from None
