"""Batches handed to an agent and never finished are found by hand-over order
(:mod:`pipeline.services.processors.delivery`)."""

from __future__ import annotations

from pipeline.services.processors.delivery import DeliveryLedger


def test_batches_finished_in_order_leave_nothing_to_fetch_again() -> None:
    ledger = DeliveryLedger()
    a = ledger.handed_over("t", 0, 9, 0)
    b = ledger.handed_over("t", 1, 19, 10)
    assert ledger.taken("t", 0, 9, a) == {}
    assert ledger.taken("t", 1, 19, b) == {}
    assert ledger.open_batches("t") == 0


def test_a_batch_handed_over_before_a_finished_one_was_lost_and_is_fetched_again() -> None:
    ledger = DeliveryLedger()
    ledger.handed_over("t", 2, 106, 0)      # dropped on the way to the agent
    ledger.handed_over("t", 2, 150, 107)    # dropped too: fetch again from the first start
    ledger.handed_over("t", 5, 71, 40)      # also lost, another partition
    later = ledger.handed_over("t", 3, 141, 0)
    assert ledger.taken("t", 3, 141, later) == {2: 0, 5: 40}
    assert ledger.open_batches("t") == 0


def test_batches_of_other_topics_and_later_ones_are_not_lost() -> None:
    ledger = DeliveryLedger()
    usage = ledger.handed_over("usage", 0, 5, 0)      # another agent, its own order
    first = ledger.handed_over("t", 0, 9, 0)
    pending = ledger.handed_over("t", 1, 19, 10)      # still queued for the agent
    assert ledger.taken("t", 0, 9, first) == {}
    assert ledger.open_batches("t") == 1 and ledger.open_batches("usage") == 1
    assert ledger.taken("t", 1, 19, pending) == {}
    assert ledger.taken("usage", 0, 5, usage) == {}


def test_a_second_delivery_of_the_same_records_replaces_the_first() -> None:
    ledger = DeliveryLedger()
    ledger.handed_over("t", 0, 9, 0)
    again = ledger.handed_over("t", 0, 9, 0)          # a seek back fetched them again
    assert ledger.taken("t", 0, 9, again) == {}
    ledger.forget()
    assert ledger.open_batches("t") == 0


def test_batches_behind_lost_ones_wait_for_the_records_fetched_again() -> None:
    ledger = DeliveryLedger()
    ledger.handed_over("t", 0, 110, 60)               # lost on the way to the agent
    later = ledger.handed_over("t", 0, 150, 111)
    other = ledger.handed_over("t", 1, 40, 0)
    assert ledger.taken("t", 0, 150, later) == {0: 60}
    # Folded now, its records would be gaps behind the lost ones; they come again.
    assert not ledger.admits(0, 111)
    assert not ledger.admits(0, 151)                  # fetched before the seek took effect
    assert ledger.taken("t", 1, 40, other) == {}
    assert ledger.admits(1, 0)                        # other partitions are folded as usual
    assert ledger.admits(0, 60)                       # the records fetched again
    assert ledger.admits(0, 151)
    ledger.taken("t", 0, 150, ledger.handed_over("t", 0, 150, 111))
    ledger.handed_over("t", 0, 170, 151)              # lost again after the rewind
    assert ledger.taken("t", 0, 190, ledger.handed_over("t", 0, 190, 171)) == {0: 151}
    ledger.forget()                                   # a rebalance: commits are the truth
    assert ledger.admits(0, 171)
