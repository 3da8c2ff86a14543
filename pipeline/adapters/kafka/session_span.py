"""Read back one session's records that come before an offset: the processors' heal.

When a processors worker meets a record of a session whose state it lacks, or holds behind
the log (a gap on a valid log), the log is right and the worker is wrong: it reads the
session's missing records back from the session topic and folds them
(:mod:`pipeline.services.processors.folding`). The session's first offset is what the lost
state would have said, so the read looks backwards instead: windows ending at the offset of
the record that gapped, each four times the last, until one holds the seq the worker
expects (or the partition's start, or ``max_span`` records). The cost is bounded by the
session's own span (at most about 4/3 of it read twice), not by the partition's history.

Only records keyed by the session and carrying a ``dsh.seq`` header are returned (every
writer of session events sets both); seqs seen twice are kept once (the first), in seq order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from pipeline.adapters.kafka.session_reader import read_committed
from pipeline.codec.records import read_headers
from pipeline.core.errors import CodecError
from pipeline.settings import Settings

FIRST_WINDOW: Final = 1_024
WINDOW_GROWTH: Final = 4


def record_seq(record: Any) -> int | None:
    """The ``dsh.seq`` header of a record (:func:`pipeline.codec.records.read_headers`);
    None without one, or with a malformed one (such a record is no event of the session)."""
    try:
        return read_headers(record.headers).seq
    except CodecError:
        return None


async def session_records_before(settings: Settings, topic: str, partition: int,
                                 session_id: str, from_seq: int, before_offset: int, *,
                                 max_span: int, timeout_s: float = 120.0
                                 ) -> Sequence[Any]:
    """The records of ``session_id`` in ``topic[partition]`` below ``before_offset`` whose
    seq is ``from_seq`` or more, one per seq, in seq order; read committed.

    Searches back at most ``max_span`` offsets: when ``from_seq`` is not found there (the
    log itself has a hole, or the session began further back), what was found is returned
    and the caller sees that it does not start at ``from_seq``.
    """
    window = min(FIRST_WINDOW, max_span)
    while True:
        start = max(0, before_offset - window)
        found = await _records_of(settings, topic, partition, session_id, start,
                                  before_offset, timeout_s)
        if from_seq in found or start == 0 or window >= max_span:
            return [found[seq] for seq in sorted(found) if seq >= from_seq]
        window = min(window * WINDOW_GROWTH, max_span)


async def _records_of(settings: Settings, topic: str, partition: int, session_id: str,
                      start: int, end: int, timeout_s: float) -> dict[int, Any]:
    key = session_id.encode()
    found: dict[int, Any] = {}

    def visit(record: Any) -> bool:
        if record.offset >= end:
            return False
        if record.key == key:
            seq = record_seq(record)
            if seq is not None:
                found.setdefault(seq, record)
        return True

    await read_committed(settings, topic, partition, visit, start_offset=start,
                         timeout_s=timeout_s,
                         what=f"read back session {session_id[:80]!r} from {topic}"
                              f"[{partition}] offsets {start}-{end - 1}")
    return found
