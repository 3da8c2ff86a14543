"""faust's changelog table, for changelogs that can have two writers at once.

The processors do not write their tables in transactions, so nothing fences a worker that
lost a partition: its table writes still in flight (a produce retried after a broker fault)
and the folds it makes before it learns of the rebalance (a session expired during a
network fault) land in the changelog partition after those of the partition's new owner.
The chaos campaign's changelogs show it: one producer's writes, another's, then the first
one's again. faust assumes one writer and draws two wrong conclusions from it:

- **The local store's changelog offset.** faust stores, beside a RocksDB store's data, the
  changelog offset of the last write of its own that was acknowledged, and a later
  recovery of the partition on this worker reads the changelog only past it. Past another
  writer's records, that offset claims records the store never held: a session the other
  owner created there was missing from the store for good (the defect of seed 22142: its
  valid events were then dead-lettered as gaps). Rule: a write's acknowledgement moves the
  stored offset only when it is the very next offset (nothing else was written in
  between); a recovery or standby read moves it as faust does. Otherwise it stays where
  it is, and the next recovery reads the other writer's records too, in log order.
- **The last value of a key.** A late write of the old owner can be older than what the
  new owner wrote before it. A table may name which of two values is the newer
  (``older``): a changelog record older than the value the store holds is not applied.
- **The newest value is also the last by offset.** Compaction keeps a key's last record by
  offset, so once it ran, a late older record skipped by the rule above would be the only
  one left, and every rebuild from an empty store would restore it (seed 1796662786: two
  sessions rebuilt with a ``next`` seqs behind their log, and no later event to heal them).
  So the keys whose records were skipped are remembered per changelog partition, and when
  a recovery ends with that partition active on this worker (a standby's at its
  promotion), the value held is written again: after the late record, by the partition's
  owner, before any batch of it is folded.

The rules only make a recovery read more, keep a newer value, or write a held value again:
never less than faust.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import faust
from faust.stores.memory import Store as MemoryStore

log = logging.getLogger(__name__)

# (value held, value of a changelog record) -> whether the record's value is older than the
# one held (it is then not applied); both as the table holds them (decoded).
Older = Callable[[Any, Any], bool]


def next_stored_offset(stored: int | None, acknowledged: int) -> int | None:
    """The store's changelog offset once a write of its own was acknowledged at
    ``acknowledged``: moved only when nothing was written in between (``None``: the store
    holds no record yet, so only offset 0 follows)."""
    if acknowledged == (-1 if stored is None else stored) + 1:
        return acknowledged
    return stored


class ChangelogTable(faust.Table[Any, Any]):
    """faust's table with the two rules of this module."""

    def __init__(self, *args: Any, older: Older | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.older = older
        self.stale_skipped = 0   # changelog records older than the value held
        self.stale_rewritten = 0   # held values written again after such a record
        self._held_back: set[Any] = set()   # partitions whose stored offset stays
        # changelog partition -> keys with a skipped older record after their held value
        self._stale_keys: dict[int, set[Any]] = {}

    def _on_changelog_sent(self, fut: Any) -> None:
        if isinstance(self.data, MemoryStore):   # keeps no offset: recovers everything
            super()._on_changelog_sent(fut)
            return
        metadata = fut.result()
        tp, offset = metadata.topic_partition, metadata.offset
        stored = self.data.persisted_offset(tp)
        if next_stored_offset(stored, offset) == offset:
            super()._on_changelog_sent(fut)
        elif tp not in self._held_back and (stored is None or offset > stored):
            self._held_back.add(tp)   # said once, until a read moves the offset again
            log.warning("%s[%d]: this worker's write landed at offset %d, not right after "
                        "%s: another writer wrote in between; the local store's changelog "
                        "offset stays, so a recovery here reads those records too",
                        tp.topic, tp.partition, offset, stored)

    def apply_changelog_batch(self, batch: Iterable[Any]) -> None:
        if self.older is not None:
            before = self.stale_skipped
            batch = self._newer_only(batch)
            if self.stale_skipped > before:
                log.warning("%s: %d changelog records older than the values held were not "
                            "applied (late writes of a worker that had lost the partition)",
                            self.name, self.stale_skipped - before)
        batch = list(batch)
        self._held_back.difference_update({event.message.tp for event in batch})
        super().apply_changelog_batch(batch)

    def _newer_only(self, batch: Iterable[Any]) -> list[Any]:
        older, kept = self.older, []
        latest: dict[Any, Any] = {}
        assert older is not None
        for event in batch:
            key = self._to_key(event.key)
            if event.message.value is not None:
                held = latest[key] if key in latest else self.data.get(key)
                if held is not None and older(held, event.value):
                    self.stale_skipped += 1
                    self._stale_keys.setdefault(event.message.partition, set()).add(key)
                    continue
            latest[key] = None if event.message.value is None else event.value
            kept.append(event)
        return kept

    async def on_recovery_completed(self, active_tps: set[Any], standby_tps: set[Any]) -> None:
        await super().on_recovery_completed(active_tps, standby_tps)
        self.rewrite_stale({tp.partition for tp in active_tps},
                           {tp.partition for tp in standby_tps})

    def rewrite_stale(self, active: set[int], standby: set[int]) -> int:
        """Write again the held value of each key whose older record was skipped on an
        ``active`` changelog partition (the module's third rule); keep the keys of
        ``standby`` partitions for their promotion, forget those of partitions gone.
        Returns the number of records written."""
        written = 0
        for partition in list(self._stale_keys):
            if partition in active:
                for key in self._stale_keys.pop(partition):
                    held = self.data.get(key)
                    if held is not None:   # deleted since: a tombstone came after it
                        self.send_changelog(partition, key, held)
                        written += 1
            elif partition not in standby:
                del self._stale_keys[partition]
        if written:
            self.stale_rewritten += written
            log.warning("%s: %d held values written again after older late records, so "
                        "that compaction keeps them", self.name, written)
        return written
