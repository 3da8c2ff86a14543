"""The commit rule of the batching transport (:mod:`pipeline.adapters.faust.commit_rule`): an
offset is committed only when every record below it, from the committed offset on, is in a
span whose outputs are acknowledged, whose state is written and whose writes are flushed."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from pipeline.adapters.faust.commit_rule import Span, commit_offset


def done(start: int, end: int) -> Span:
    return Span(start, end, outputs_acknowledged=True, state_written=True, flushed=True)


# Offset 10 is a transaction marker: the batch 0..9 drained it (span end 11), so the next
# batch's span starts at 11.
SPANS = [done(0, 5), done(5, 11), done(11, 21), done(21, 32)]


def test_done_spans_in_order_commit_past_the_last() -> None:
    assert commit_offset(SPANS[:2], None) == 11
    assert commit_offset(SPANS[2:], 11) == 32


def test_a_span_not_done_holds_back_every_later_one() -> None:
    # Batch 5..10 is still being folded, failed, was skipped or lost: nothing past 4.
    assert commit_offset([SPANS[0], *SPANS[2:]], None) == 5
    assert commit_offset(SPANS[2:], 5) is None


def test_each_stage_is_required() -> None:
    for missing in ("outputs_acknowledged", "state_written", "flushed"):
        half = replace(SPANS[1], **{missing: False})
        assert commit_offset([SPANS[0], half, *SPANS[2:]], 0) == 5, missing
        assert not half.done


def test_before_the_first_commit_the_run_starts_at_the_lowest_span_known() -> None:
    waiting = Span(0, 5, outputs_acknowledged=True, state_written=True)   # not flushed
    assert commit_offset([waiting, *SPANS[1:]], None) is None


def test_a_span_that_starts_at_a_marker_commits_from_the_committed_offset() -> None:
    # Committed at 10 (the marker) by an earlier owner; the fetch from 10 skipped it.
    assert commit_offset([done(10, 21)], 10) == 21
    # Starting at the first record (11) would leave a hole after the commit for good.
    assert commit_offset([done(11, 21)], 10) is None


def test_a_drain_that_handed_out_only_a_marker_fills_the_hole() -> None:
    assert commit_offset([done(37, 39)], 36) is None
    assert commit_offset([done(37, 39), Span.without_records(36, 37)], 36) == 39


def test_spans_already_committed_and_overlapping_spans_never_move_the_commit_back() -> None:
    assert commit_offset([done(5, 11)], 30) is None
    assert commit_offset([done(0, 11), done(5, 21)], 0) == 21


def test_records_delivered_twice_are_done_when_one_delivery_is() -> None:
    again = Span(0, 10)   # a second delivery still being folded
    assert commit_offset([again, done(0, 5), done(5, 12)], 0) == 12


STAGES = st.tuples(st.booleans(), st.booleans(), st.booleans())
SPAN = st.builds(lambda start, length, stages: Span(start, start + length, *stages),
                 st.integers(0, 60), st.integers(1, 12), STAGES)
SPAN_LISTS = st.lists(SPAN, max_size=14)
COMMITTED = st.one_of(st.none(), st.integers(0, 70))


def covered_by_done(spans: list[Span], offset: int) -> bool:
    return any(span.done and span.start <= offset < span.end for span in spans)


@given(SPAN_LISTS, COMMITTED)
def test_every_offset_up_to_the_commit_is_in_a_done_span(spans: list[Span],
                                                          committed: int | None) -> None:
    offset = commit_offset(spans, committed)
    if offset is None:
        return
    start = committed if committed is not None else min(span.start for span in spans)
    assert offset > start
    assert all(covered_by_done(spans, o) for o in range(start, offset))


@given(SPAN_LISTS, COMMITTED)
def test_the_commit_goes_as_far_as_the_done_spans_allow(spans: list[Span],
                                                         committed: int | None) -> None:
    offset = commit_offset(spans, committed)
    if not spans:
        assert offset is None
        return
    start = committed if committed is not None else min(span.start for span in spans)
    reached = start if offset is None else offset
    assert not covered_by_done(spans, reached)


@given(SPAN_LISTS, COMMITTED, st.randoms())
def test_the_order_spans_are_reported_in_does_not_matter(
        spans: list[Span], committed: int | None, rnd: object) -> None:
    shuffled = list(spans)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert commit_offset(shuffled, committed) == commit_offset(spans, committed)


@given(SPAN_LISTS, st.integers(0, 70), SPAN)
def test_a_span_not_done_never_moves_the_commit(spans: list[Span], committed: int,
                                                extra: Span) -> None:
    pending = replace(extra, flushed=False)
    assert commit_offset([*spans, pending], committed) == commit_offset(spans, committed)


@given(SPAN_LISTS, st.integers(0, 70), SPAN)
def test_a_span_done_later_never_moves_the_commit_back(spans: list[Span], committed: int,
                                                       extra: Span) -> None:
    before = commit_offset(spans, committed) or committed
    after = commit_offset([*spans, extra], committed) or committed
    assert after >= before
