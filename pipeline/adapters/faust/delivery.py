"""Which fetched batches never reached the agent: found by delivery order, fetched again.

Rules:

- One agent takes a topic's batches in the order they were handed over, so a batch handed
  over *before* one the agent took, and not taken itself, was lost on the way (faust drops
  a hand-over when flow control is suspended meanwhile). :class:`DeliveryLedger` finds
  them and the consumer seeks their partition back to where the first of them started; the
  folds skip what was folded already, by seq.
- No rewind when the lost records are coming again already (in the batch taken or one
  handed over after it): fetched a third time they would be folded twice.
- Until the records fetched again arrive, the partition's batches already on their way are
  not folded (:meth:`DeliveryLedger.admits`): folded now they would be gaps.
- A batch whose folding failed was taken: the folds gave up their partition's batches since
  their last persist, so the partition is read again from its committed offset
  (:meth:`DeliveryLedger.hold` until that offset is known, then
  :meth:`DeliveryLedger.fetch_again_from`); the service decides how often before it stops.
- A rebalance forgets everything: every partition is read again from its committed offset.
"""

from __future__ import annotations

from typing import Any


class DeliveryLedger:
    """Batches handed to the agents and not taken yet, by topic, in hand-over order."""

    __slots__ = ("_next", "_open", "_refetching")

    def __init__(self) -> None:
        self._next = 0
        # topic -> (partition key, last offset) -> (hand-over number, first offset covered)
        self._open: dict[str, dict[tuple[Any, int], tuple[int, int]]] = {}
        self._refetching: dict[Any, int] = {}   # partition key -> offset fetched again from

    def handed_over(self, topic: str, partition: Any, last: int, start: int) -> int:
        """Record a batch handed over; returns its hand-over number."""
        number = self._next
        self._next += 1
        self._open.setdefault(topic, {})[(partition, last)] = (number, start)
        return number

    def taken(self, topic: str, partition: Any, last: int, number: int, start: int
              ) -> dict[Any, int]:
        """The agent took batch ``number`` (of ``partition``, offsets ``start``..``last``).
        Returns, per partition, the offset to fetch again from: where the earliest batch
        handed over before it, and never taken, started. Those are forgotten (their records
        come again). Not when the records of a lost batch are on their way already (a
        seek fetched them again into this batch or into one handed over after it)."""
        open_batches = self._open.get(topic, {})
        entry = open_batches.get((partition, last))
        if entry is not None and entry[0] <= number:
            del open_batches[(partition, last)]
        lost = [(key, first) for key, (n, first) in open_batches.items() if n < number]
        for key, _ in lost:
            del open_batches[key]
        coming = [(key[0], first) for key, (n, first) in open_batches.items() if n > number]
        coming.append((partition, start))
        rewind: dict[Any, int] = {}
        for (lost_partition, _), first in lost:
            if any(p == lost_partition and begins <= first for p, begins in coming):
                continue
            rewind[lost_partition] = min(first, rewind.get(lost_partition, first))
        for key, first in rewind.items():
            self._refetching[key] = min(first, self._refetching.get(key, first))
        return rewind

    def admits(self, partition: Any, start: int) -> bool:
        """Whether a batch taken from ``partition``, covering offsets from ``start``, is to
        be folded: not while the partition is fetched again from an earlier offset and this
        batch does not start there (it comes again)."""
        again = self._refetching.get(partition)
        if again is None:
            return True
        if start <= again:
            del self._refetching[partition]   # the records fetched again have arrived
            return True
        return False

    def hold(self, partition: Any) -> None:
        """Fold no batch of ``partition`` until :meth:`fetch_again_from` says where its
        records come again from (a batch of it failed: later ones would be gaps)."""
        self._refetching[partition] = -1

    def fetch_again_from(self, partition: Any, offset: int) -> None:
        """``partition`` is read again from ``offset`` (its committed offset): batches
        starting after it are not folded until one starting there is taken."""
        self._refetching[partition] = offset

    def forget(self) -> None:
        """A rebalance: every partition is fetched again from its committed offset."""
        self._open.clear()
        self._refetching.clear()

    def open_batches(self, topic: str) -> int:
        return len(self._open.get(topic, {}))
