"""Delivery bookkeeping by (session id, seq): duplicates skipped, gaps reported.

Kafka delivers at least once; every consumer that folds session events keeps the last seq
it applied per session. A seq at or below it is a duplicate (skip it); a seq that skips
ahead is a gap (report it and do not fold past it: the fold would be wrong from there on).
"""

from __future__ import annotations

from enum import Enum


class Delivery(Enum):
    """What to do with one delivered (session, seq)."""

    APPLY = "apply"
    DUPLICATE = "duplicate"
    GAP = "gap"


class SeqTracker:
    """Last applied seq per session. ``check`` classifies; ``applied`` records success."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def expected(self, session_id: str) -> int:
        """The seq the next event of ``session_id`` must carry (0 for an unseen session)."""
        return self._last.get(session_id, -1) + 1

    def check(self, session_id: str, seq: int) -> Delivery:
        expected = self.expected(session_id)
        if seq < expected:
            return Delivery.DUPLICATE
        if seq > expected:
            return Delivery.GAP
        return Delivery.APPLY

    def applied(self, session_id: str, seq: int) -> None:
        self._last[session_id] = seq

    def sessions(self) -> int:
        return len(self._last)
