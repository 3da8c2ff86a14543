"""Batches handed to an agent and never finished are found by hand-over order
(:mod:`pipeline.adapters.faust.delivery`)."""

from __future__ import annotations

from pipeline.adapters.faust.delivery import DeliveryLedger


def test_batches_finished_in_order_leave_nothing_to_fetch_again() -> None:
    ledger = DeliveryLedger()
    a = ledger.handed_over("t", 0, 9, 0)
    b = ledger.handed_over("t", 1, 19, 10)
    assert ledger.taken("t", 0, 9, a, 0) == {}
    assert ledger.taken("t", 1, 19, b, 10) == {}
    assert ledger.open_batches("t") == 0


def test_a_batch_handed_over_before_a_finished_one_was_lost_and_is_fetched_again() -> None:
    ledger = DeliveryLedger()
    ledger.handed_over("t", 2, 106, 0)      # dropped on the way to the agent
    ledger.handed_over("t", 2, 150, 107)    # dropped too: fetch again from the first start
    ledger.handed_over("t", 5, 71, 40)      # also lost, another partition
    later = ledger.handed_over("t", 3, 141, 0)
    assert ledger.taken("t", 3, 141, later, 0) == {2: 0, 5: 40}
    assert ledger.open_batches("t") == 0


def test_batches_of_other_topics_and_later_ones_are_not_lost() -> None:
    ledger = DeliveryLedger()
    usage = ledger.handed_over("usage", 0, 5, 0)      # another agent, its own order
    first = ledger.handed_over("t", 0, 9, 0)
    pending = ledger.handed_over("t", 1, 19, 10)      # still queued for the agent
    assert ledger.taken("t", 0, 9, first, 0) == {}
    assert ledger.open_batches("t") == 1 and ledger.open_batches("usage") == 1
    assert ledger.taken("t", 1, 19, pending, 10) == {}
    assert ledger.taken("usage", 0, 5, usage, 0) == {}


def test_a_second_delivery_of_the_same_records_replaces_the_first() -> None:
    ledger = DeliveryLedger()
    ledger.handed_over("t", 0, 9, 0)
    again = ledger.handed_over("t", 0, 9, 0)          # a seek back fetched them again
    assert ledger.taken("t", 0, 9, again, 0) == {}
    ledger.forget()
    assert ledger.open_batches("t") == 0


def test_batches_behind_lost_ones_wait_for_the_records_fetched_again() -> None:
    ledger = DeliveryLedger()
    ledger.handed_over("t", 0, 110, 60)               # lost on the way to the agent
    later = ledger.handed_over("t", 0, 150, 111)
    other = ledger.handed_over("t", 1, 40, 0)
    assert ledger.taken("t", 0, 150, later, 111) == {0: 60}
    # Folded now, its records would be gaps behind the lost ones; they come again.
    assert not ledger.admits(0, 111)
    assert not ledger.admits(0, 151)                  # fetched before the seek took effect
    assert ledger.taken("t", 1, 40, other, 0) == {}
    assert ledger.admits(1, 0)                        # other partitions are folded as usual
    assert ledger.admits(0, 60)                       # the records fetched again
    assert ledger.admits(0, 151)
    ledger.taken("t", 0, 150, ledger.handed_over("t", 0, 150, 111), 111)
    ledger.handed_over("t", 0, 170, 151)              # lost again after the rewind
    assert ledger.taken("t", 0, 190, ledger.handed_over("t", 0, 190, 171), 171) == {0: 151}
    ledger.forget()                                   # a rebalance: commits are the truth
    assert ledger.admits(0, 171)


def test_records_already_on_their_way_again_are_not_fetched_a_third_time() -> None:
    """faust's recovery seeks to the committed offsets after fetching began: the batch
    fetched before the seek is dropped, and its records come again with the seek."""
    ledger = DeliveryLedger()
    ledger.handed_over("t", 0, 706, 601)                # dropped
    again = ledger.handed_over("t", 0, 720, 601)        # the seek: the same records, and more
    assert ledger.taken("t", 0, 720, again, 601) == {}
    assert ledger.admits(0, 601)
    # Dropped, and its records handed over again but not taken yet when another is taken.
    ledger.handed_over("t", 1, 50, 10)
    other = ledger.handed_over("t", 0, 730, 721)
    refetched = ledger.handed_over("t", 1, 60, 10)
    assert ledger.taken("t", 0, 730, other, 721) == {}
    assert ledger.taken("t", 1, 60, refetched, 10) == {}
    assert ledger.admits(1, 10) and ledger.open_batches("t") == 0
    # Records lost before what comes again are still fetched again.
    ledger.handed_over("t", 1, 80, 61)
    after = ledger.handed_over("t", 1, 95, 81)         # starts past the lost records
    assert ledger.taken("t", 1, 95, after, 81) == {1: 61}


def test_a_partition_whose_batch_failed_folds_nothing_until_read_again() -> None:
    """A batch failed: its partition is held (later batches would be gaps) until it is
    read again from its committed offset; the first batch starting there releases it."""
    ledger = DeliveryLedger()
    ledger.hold(0)
    assert not ledger.admits(0, 0)                    # where it is read from is not known yet
    assert not ledger.admits(0, 200)
    assert ledger.admits(1, 200)                      # other partitions go on
    ledger.fetch_again_from(0, 120)                   # its committed offset
    assert not ledger.admits(0, 200)                  # fetched before the seek took effect
    assert ledger.admits(0, 120)                      # the records read again
    assert ledger.admits(0, 200)
    ledger.hold(0)
    ledger.forget()                                   # a rebalance reads it again anyway
    assert ledger.admits(0, 300)
