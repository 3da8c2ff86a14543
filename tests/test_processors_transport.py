"""What the batching consumer commits (pure part of :mod:`pipeline.services.processors.transport`):
only the run of acked batches that starts at the committed offset."""

from __future__ import annotations

from pipeline.services.processors.transport import committable

# Batches of one partition: first offset by last offset.
FIRSTS = {4: 0, 9: 5, 10: 10, 30: 11}


def test_acked_batches_in_order_commit_past_the_last() -> None:
    assert committable([4, 9], FIRSTS, None) == (10, {4, 9})
    assert committable([10, 30], FIRSTS, 10) == (31, {10, 30})


def test_an_unacked_batch_holds_back_every_later_one() -> None:
    # Batch 5..9 is still being folded, or failed (never acked): nothing past 4 is committed.
    assert committable([4, 10, 30], FIRSTS, None) == (5, {4})
    assert committable([10, 30], FIRSTS, 5) == (None, set())


def test_the_first_batch_after_a_restart_may_start_at_the_committed_offset() -> None:
    assert committable([9], FIRSTS, 5) == (10, {9})
    assert committable([], FIRSTS, 5) == (None, set())
