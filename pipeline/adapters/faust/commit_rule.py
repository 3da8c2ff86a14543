"""The one rule for committing a batched partition's offset, as a pure function.

An offset is committed only when every data record below it, from the committed offset on,
belongs to a batch whose outputs are acknowledged by the broker, whose state (table
records) is written, and whose writes are flushed (acknowledged, acks=all). The consumer
(:class:`.transport.BatchingConsumer`) keeps one :class:`Span` per fetched batch that the
folds reported folded, and per range aiokafka skipped without a record (transaction
markers, aborted records: nothing to output or write), and asks :func:`commit_offset`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Span:
    """Offsets ``start`` (inclusive) to ``end`` (exclusive) of one partition, and how far the
    records in them went."""

    start: int
    end: int
    outputs_acknowledged: bool = False
    state_written: bool = False
    flushed: bool = False

    @property
    def done(self) -> bool:
        """Every record of the span may be committed."""
        return self.outputs_acknowledged and self.state_written and self.flushed

    @classmethod
    def without_records(cls, start: int, end: int) -> Span:
        """A range aiokafka moved past handing out no record: nothing to do for it."""
        return cls(start, end, outputs_acknowledged=True, state_written=True, flushed=True)


def commit_offset(spans: Iterable[Span], committed: int | None) -> int | None:
    """The offset to commit, or None when it does not move.

    ``committed``: the committed offset (the next to read), None before the first commit
    (the run then starts at the lowest span known). The result is the end of the run of
    done spans that starts at ``committed`` with no hole: an offset no span covers, or a
    span not done (outputs unacknowledged, state unwritten or unflushed), ends the run, so
    nothing after it is committed. An offset is done when any done span covers it (records
    delivered twice, one delivery done, are done).
    """
    spans = list(spans)
    if not spans:
        return None
    position = committed if committed is not None else min(span.start for span in spans)
    moved = False
    for span in sorted(span for span in spans if span.done):
        if span.start > position:
            break
        if span.end > position:
            position, moved = span.end, True
    return position if moved else None
