"""Which sessions' checkpoints a transaction writes, and where a takeover's tail starts.

Writing every touched session's checkpoint in every transaction cost the driver about 125 us
of CPU per checkpoint, most of it the checkpoint's JSON, and a two-step turn took about four
(BENCHMARKS.md, issue 28). So a session's checkpoint is written only:

- at a **rest point**: the transaction leaves it idle (outside a turn, with no inbox work
  that wakes it: the turn ended, a configure entered while idle) or waiting for a person's
  approval;
- when it is **old**: its first event newer than its checkpoint lies more than
  ``tail_records`` session-topic offsets behind the partition's end (a long or slow turn);
- when it is **wanted**: the session is to leave memory (eviction needs its checkpoint to hold
  everything), or the sink closes (a graceful release leaves no tail);
- always while this owner does not know where the session partition ends (a sink used
  without a takeover, as some tests do).

A session with committed events newer than its latest checkpoint is *dirty*. The transaction
that commits a dirty session's events also commits, in its inbox offset's metadata, a *tail
mark* (``"tail":offset``, :class:`~pipeline.services.driver.inbox_offsets.InboxOffsets`) at or
below the first of those events: a takeover reads the session partition from the mark to its
end and folds each dirty session's newer events onto its checkpoint (``takeover.py``). The mark
only rises, and a lower mark is never wrong (the takeover skips events its checkpoints cover),
so it is committed again only when it rose by ``tail_slack`` offsets or the last dirty session
was checkpointed (no mark: the takeover reads no session record). The tail a takeover reads
is then at most about ``tail_records + tail_slack`` offsets plus one transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from pipeline.core.checkpoint import SessionCheckpoint

TAIL_RECORDS: Final = 20_000  # a dirty session this far behind the end is checkpointed
TAIL_SLACK: Final = 1_000  # the committed mark may lag the exact one by this many offsets


def at_rest(checkpoint: SessionCheckpoint) -> bool:
    """Idle (outside a turn, no inbox work that wakes it), or waiting for a person's
    approval."""
    return not checkpoint.busy or checkpoint.approval_asked_at is not None


class CheckpointPlan:
    """The dirty sessions of one partition, and the tail mark its transactions commit."""

    def __init__(self, *, mark: int | None, tail_records: int = TAIL_RECORDS,
                 tail_slack: int = TAIL_SLACK) -> None:
        """``mark``: the tail mark found at takeover (committed again until it is passed)."""
        # session -> offset at or below its first newer event, in offset order (entries are
        # added at the end known when they were committed, which only rises)
        self.dirty: dict[str, int] = {}
        self.mark = mark
        self._end: int | None = None  # one past the newest session-topic offset known
        self._wanted: set[str] = set()
        self._tail_records = tail_records
        self._tail_slack = tail_slack
        self.written = 0  # checkpoints chosen (the metric's count)

    def resume(self, dirty: Iterable[str], end: int) -> None:
        """A takeover read the tail from :attr:`mark` (if any) to ``end``; ``dirty`` had
        newer events there than their checkpoints."""
        for session_id in dirty:
            assert self.mark is not None
            self.dirty[session_id] = self.mark
        self._end = end

    def want(self, session_id: str) -> None:
        """Write the session's checkpoint with the next transaction (it leaves memory)."""
        self._wanted.add(session_id)

    def clean(self, session_id: str) -> bool:
        return session_id not in self.dirty

    def choose(self, touched: Iterable[str], folds: Mapping[str, SessionCheckpoint], *,
               closing: bool) -> list[str]:
        """The sessions whose checkpoint the next transaction writes (in ``folds``)."""
        chosen: dict[str, None] = {}
        for session_id in touched:
            fold = folds.get(session_id)
            if fold is not None and (closing or self._end is None or at_rest(fold)
                                     or session_id in self._wanted):
                chosen[session_id] = None
        old = None if self._end is None else self._end - self._tail_records
        for session_id, offset in self.dirty.items():  # the oldest first
            if not closing and (old is None or offset >= old):
                break
            chosen[session_id] = None
        chosen.update((s, None) for s in self._wanted if s in self.dirty)
        self._wanted.clear()
        found = [session_id for session_id in chosen if session_id in folds]
        self.written += len(found)
        return found

    def mark_for(self, touched: Iterable[str], chosen: Iterable[str]) -> int | None:
        """The tail mark the next transaction commits (before it is sent)."""
        done = set(chosen)
        left = [next((o for s, o in self.dirty.items() if s not in done), None)]  # the oldest
        if self._end is not None and any(s not in done and s not in self.dirty for s in touched):
            left.append(self._end)  # its events land at or after the end known now
        exact = min((o for o in left if o is not None), default=None)
        if exact is None or self.mark is None or not 0 <= exact - self.mark < self._tail_slack:
            self.mark = exact
        return self.mark

    def committed(self, touched: Iterable[str], chosen: Iterable[str], end: int | None
                  ) -> None:
        """The transaction committed; ``end``: one past its last session-topic record."""
        done = set(chosen)
        for session_id in done:
            self.dirty.pop(session_id, None)
        if self._end is not None:
            for session_id in touched:
                if session_id not in done and session_id not in self.dirty:
                    self.dirty[session_id] = self._end
        if end is not None:
            self._end = end if self._end is None else max(end, self._end)
