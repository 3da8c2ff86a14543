"""What the batching consumer commits (pure part of :mod:`pipeline.services.processors.transport`):
the end of the run of folded spans that starts at the committed offset."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.services.processors.transport import RecordBatch, committable

# Offset 10 is a transaction marker: the batch 0..9 drained it (span end 11), so the next
# batch's span starts at 11.
SPANS = [(0, 5), (5, 11), (11, 21), (21, 32)]


def test_folded_spans_in_order_commit_past_the_last() -> None:
    assert committable(SPANS[:2], None) == 11
    assert committable(SPANS[2:], 11) == 32


def test_a_span_not_folded_holds_back_every_later_one() -> None:
    # Batch 5..9 is still being folded, failed, was skipped or lost: nothing past 4.
    assert committable([SPANS[0], *SPANS[2:]], None) == 5
    assert committable(SPANS[2:], 5) is None


def test_a_span_that_starts_at_a_marker_commits_from_the_committed_offset() -> None:
    # Committed at 10 (the marker) by an earlier owner; the fetch from 10 skipped it.
    assert committable([(10, 21)], 10) == 21
    # Starting at the first record (11) would leave a hole after the commit for good.
    assert committable([(11, 21)], 10) is None


def test_a_drain_that_handed_out_only_a_marker_fills_the_hole() -> None:
    # Committed 36; aiokafka drained the marker at 36 with no record, then 37..38.
    assert committable([(37, 39)], 36) is None
    assert committable([(37, 39), (36, 37)], 36) == 39


def test_spans_already_committed_and_overlapping_spans_never_move_the_commit_back() -> None:
    assert committable([(5, 11)], 30) is None
    assert committable([(0, 11), (5, 21)], 0) == 21


def _span(records: list[int], span: tuple[int | None, int | None]) -> tuple[int, int]:
    batch = RecordBatch([SimpleNamespace(offset=o) for o in records], span)
    return batch.start, batch.end


def test_a_batch_span_must_contain_its_records_or_the_records_are_the_span() -> None:
    assert _span([11, 12], (10, 14)) == (10, 14)
    assert _span([11, 12], (None, None)) == (11, 13)
    # A position read after a seek elsewhere cannot claim offsets the records do not reach.
    assert _span([11, 12], (12, 12)) == (11, 13)
