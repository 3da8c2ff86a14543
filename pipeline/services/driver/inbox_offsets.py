"""Which inbox offsets of one owned partition are done, and the metadata their commit carries.

The inbox offset of partition p is committed inside the partition's transactions
(``kafka_sink.py``); its metadata names what a re-delivery could not recognise in the log
(cancels applied and records dead-lettered beyond the commit point), and where a takeover
starts reading the session partition's tail (``"tail"``: sessions whose events are newer than
their latest checkpoint, ``checkpoint_plan.py``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from pipeline.core.events import dumps_json

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InboxOffsets:
    """Which inbox offsets of one partition are dispatched and which are done.

    Offsets are not contiguous (transaction markers take offsets), so the commit point is
    the first dispatched offset not yet done, or one past the last one seen.

    A cancel leaves no message id in the log, so a re-delivery could not be recognised
    there: the message ids of those applied *beyond* the commit point travel in the commit's
    metadata (``{"applied":[ids]}``), atomically with the events, and the next owner skips
    them (:meth:`already_applied`). A configure is recognised by its ``dsh-pipeline/config``
    event, like a message by its splice; ids in the metadata of older drivers still count.

    A dead-lettered record leaves nothing in the log either: its offset, when beyond the
    commit point, travels in the same metadata (``"dead":[offsets]``) with its dead letter,
    so the next owner does not dead-letter it a second time (:meth:`already_dead_lettered`).

    What the metadata found at assignment names is carried into every commit until its record
    comes again (an offset not yet seen, an id not yet met): a commit of this owner before it
    reaches them must not forget them for the owner after it.

    ``tail`` (``"tail":offset``, set by the sink before each :meth:`advance`) is where the
    next owner starts reading the session partition: sessions checkpointed only at rest
    points have newer events there (``checkpoint_plan.py``). It is never dropped.
    """

    committed: int
    applied_before: frozenset[str] = frozenset()  # from the metadata found at assignment
    dead_before: frozenset[int] = frozenset()  # likewise: offsets already dead-lettered
    pending: dict[int, bool] = field(default_factory=dict)  # offset -> done, offset order
    controls: dict[int, str] = field(default_factory=dict)  # offset -> cancel/configure id
    dead_lettered: set[int] = field(default_factory=set)  # offsets whose dead letter is sent
    last_seen: int = -1
    metadata: str = ""
    tail: int | None = None  # the session-partition offset a takeover reads from (None: none)
    carried_applied: set[str] = field(init=False)  # applied_before ids not met again yet

    def __post_init__(self) -> None:
        self.carried_applied = set(self.applied_before)

    def seen(self, offset: int) -> bool:
        return offset < self.committed or offset <= self.last_seen

    def start(self, offset: int) -> None:
        self.pending[offset] = False
        self.last_seen = max(self.last_seen, offset)

    def done(self, offset: int) -> None:
        if offset in self.pending:
            self.pending[offset] = True

    def applied_control(self, offset: int, message_id: str) -> None:
        """A cancel/configure at ``offset`` took effect (or was found applied already)."""
        self.controls[offset] = message_id
        self.carried_applied.discard(message_id)

    def already_applied(self, message_id: str) -> bool:
        return message_id in self.applied_before

    def dead_letter(self, offset: int) -> None:
        """The record at ``offset`` went to the dead-letter topic (or already had): done."""
        self.dead_lettered.add(offset)
        self.done(offset)

    def already_dead_lettered(self, offset: int) -> bool:
        return offset in self.dead_before

    def advance(self) -> tuple[int, str] | None:
        """(commit point, metadata) when either changed since the last call, else None."""
        for offset in list(self.pending):
            if not self.pending[offset]:
                break
            del self.pending[offset]
        point = next(iter(self.pending), self.last_seen + 1)
        for offset in [o for o in self.controls if o < point]:
            del self.controls[offset]
        self.dead_lettered = {o for o in self.dead_lettered if o >= point}
        applied = sorted(self.carried_applied) + [
            i for o, i in sorted(self.controls.items()) if self.pending.get(o)]
        dead = sorted({o for o in self.dead_lettered if self.pending.get(o)}
                      | {o for o in self.dead_before if o > self.last_seen and o >= point})
        metadata = _commit_metadata(applied, dead, self.tail)
        if point > self.committed or metadata != self.metadata:
            self.committed = max(point, self.committed)
            self.metadata = metadata
            return self.committed, metadata
        return None

    @property
    def in_flight(self) -> int:
        return sum(1 for done in self.pending.values() if not done)


MAX_METADATA_CHARS = 4000  # the broker's offset.metadata.max.bytes defaults to 4096


def _commit_metadata(message_ids: list[str], dead_offsets: list[int],
                     tail: int | None = None) -> str:
    def text() -> str:
        content: dict[str, list[str] | list[int] | int] = {}
        if tail is not None:  # never dropped: a takeover without it would miss events
            content["tail"] = tail
        if message_ids:
            content["applied"] = message_ids
        if dead_offsets:
            content["dead"] = dead_offsets
        return dumps_json(content) if content else ""

    if len(text()) > MAX_METADATA_CHARS:
        log.warning("inbox commit metadata too long; a re-delivered control command or bad "
                    "record may be applied or dead-lettered twice after a crash")
    while len(text()) > MAX_METADATA_CHARS:
        # Oldest first out: it is the most likely to be committed soon.
        if message_ids:
            message_ids = message_ids[1:]
        else:
            dead_offsets = dead_offsets[1:]
    return text()


def _metadata_field(metadata: str, name: str) -> object:
    if not metadata:
        return None
    try:
        return json.loads(metadata).get(name)
    except (ValueError, AttributeError):
        log.warning("ignoring unreadable inbox commit metadata %r", metadata[:80])
        return None


def _metadata_list(metadata: str, name: str) -> list[object]:
    found = _metadata_field(metadata, name)
    return found if isinstance(found, list) else []


def applied_from_metadata(metadata: str) -> frozenset[str]:
    """The control-command ids a committed offset's metadata says were applied."""
    return frozenset(i for i in _metadata_list(metadata, "applied") if isinstance(i, str))


def dead_lettered_from_metadata(metadata: str) -> frozenset[int]:
    """The inbox offsets a committed offset's metadata says were dead-lettered already."""
    return frozenset(o for o in _metadata_list(metadata, "dead")
                     if isinstance(o, int) and not isinstance(o, bool))


def tail_from_metadata(metadata: str) -> int | None:
    """The session-partition offset a takeover must read the tail from (None: every session's
    latest checkpoint covers all its committed events)."""
    found = _metadata_field(metadata, "tail")
    if isinstance(found, int) and not isinstance(found, bool) and found >= 0:
        return found
    return None
