"""Usage per provider/model and per time window, on the internal topic keyed by model.

Sessions of one model live in every partition of the session topic, so per-model aggregates
cannot be table entries of the session stage (a key written from two partitions would land in
two changelog partitions). The session stage therefore sends each usage sample to an internal
topic keyed by ``provider/model``; this stage owns every model key of its partitions, with
changelogs co-partitioned with that topic. That internal topic carries samples and ticks as
JSON (only this stage reads it); the exported records on the usage topic are Avro
(``dsh.UsageRecord``, :mod:`pipeline.codec.outputs`).

**State.** One table record per (model, session), ``contrib/<provider>/<model>/<session>``:
the last seq applied (dedup), the session's total for the model and its cost, its share of
each open window, and its share of each row of the cost ledger (``ledger``: per
``<tenant>/<hour start>``, counts and exact cost, :mod:`pipeline.core.ledger`). One sample =
one record write, so a crash can never apply half a sample. Model totals, window totals
and ledger rows are sums over these records, kept in memory, updated per sample and rebuilt
from the table after every rebalance (see *The sums and the table*). Per partition,
``book/<p>`` keeps the last tick.

**The sums and the table.** Only this stage's writes change the table, except in a
rebalance: its recovery writes what the changelogs hold (the records of partitions that came
from another worker, fresher than a standby copy). So the kept sums belong to one set of
partitions *and* one settled state of the table (``epoch``: a number that changes with every
rebalance, None from a rebalance's start to the end of its recovery). While it is None, sums
are built for the answer but never kept: faust's consumer thread shows the new partitions
before the recovery has started, and sums kept then missed, for good, what the recovery
wrote afterwards (the re-delivered samples are duplicates by then).

**The ledger.** A sample's cost is priced here, at its event time, with the worker's price
table (``DSH_PRICES``); the exact cost is kept in the record, so a restart with another
table does not reprice what was folded (a fresh replay does). Ledger rows never close: a
late sample still lands in its hour's row, which is published again (``tenant/...`` keys).
A session's share of the ledger grows by one entry per hour in which it called the model.

**Closing on time.** A timer in each worker sends a *tick* (its clock reading) to the
partitions of the internal topic it owns that have a window due (its ``end + grace`` passed:
the tick closes it), and to every partition it owns at least every ``IDLE_TICK_MS`` (all of
them during a rebalance, until its tables recovered): a worker with nothing to close is not
woken each second by its own ticks (:meth:`UsageAggregator.partitions_to_tick`). The tick is
folded here like any record (faust allows table writes only while processing a record). A
window closes once ``tick >= end + grace``:
its final record is published and it leaves the in-memory sums; the contributions stay in
their records until those are next written (a window is "closed" by the book's last tick, so
a rebuild never reopens it). A sample for a closed window is late: counted in the totals,
reported (counter + log), not added to the window. A window's closing tick always reaches its
partition, so a closed window stays closed; only a window that never had a sample may still
be opened up to ``IDLE_TICK_MS`` after its ``end + grace`` (and closes at the next tick).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.outputs import OutputCodecs, default_output_codecs
from pipeline.core.events import JsonValue
from pipeline.core.ledger import RowId, ledger_record
from pipeline.core.prices import Cost, PriceTable
from pipeline.core.usage import (
    TokenCounts,
    UsageSample,
    WindowBook,
    model_record,
    window_record,
)
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.folding import Send
from pipeline.services.processors.records import json_bytes
from pipeline.services.processors.session_state import Table

log = logging.getLogger(__name__)

TICK: Final = "tick"
IDLE_TICK_MS: Final = 30_000   # the longest an owned partition goes without a tick


def tick_value(now_ms: int) -> bytes:
    return json_bytes({TICK: now_ms}) or b""


@dataclass(slots=True)
class UsageSums:
    """In-memory totals of the partitions this worker owns, rebuilt from the table."""

    partitions: frozenset[int] | None = None
    epoch: int | None = None   # the settled state of the table they were built from
    models: dict[str, TokenCounts] = field(default_factory=dict)
    model_names: dict[str, tuple[str, str]] = field(default_factory=dict)
    windows: dict[str, tuple[list[JsonValue], TokenCounts]] = field(default_factory=dict)
    window_partition: dict[str, int] = field(default_factory=dict)
    model_costs: dict[str, Cost] = field(default_factory=dict)
    ledger: dict[RowId, tuple[TokenCounts, Cost]] = field(default_factory=dict)

    def add(self, model_key: str, names: tuple[str, str], counts: TokenCounts,
            cost: Cost) -> tuple[TokenCounts, Cost]:
        self.model_names[model_key] = names
        self.models[model_key] = self.models.get(model_key, TokenCounts()) + counts
        self.model_costs[model_key] = self.model_costs.get(model_key, Cost()) + cost
        return self.models[model_key], self.model_costs[model_key]

    def add_row(self, row: RowId, counts: TokenCounts, cost: Cost) -> tuple[TokenCounts, Cost]:
        old_counts, old_cost = self.ledger.get(row, (TokenCounts(), Cost()))
        self.ledger[row] = (old_counts + counts, old_cost + cost)
        return self.ledger[row]

    def add_window(self, key: str, info: list[JsonValue], partition: int,
                   counts: TokenCounts) -> TokenCounts:
        _info, old = self.windows.get(key, (info, TokenCounts()))
        self.windows[key] = (info, old + counts)
        self.window_partition[key] = partition
        return old + counts


class UsageAggregator:
    """Folds samples and ticks of one worker's partitions of the usage-by-model topic."""

    def __init__(self, table: Table, send: Send, export_topic: str,
                 counters: DeliveryCounters, owned: Callable[[], Iterable[int]], *,
                 grace_ms: int, sizes: Mapping[str, int],
                 epoch: Callable[[], int | None] = lambda: 0,
                 outputs: OutputCodecs | None = None,
                 prices: PriceTable | None = None) -> None:
        self.table = table
        self.prices = prices or PriceTable()   # no table: every call unpriced
        self.outputs = outputs or default_output_codecs()  # the export topic is Avro
        self.send = send
        self.export_topic = export_topic
        self.counters = counters
        self.owned = owned
        self.grace_ms = grace_ms
        self.sizes = sizes
        self.epoch = epoch
        self.sums = UsageSums()
        self._ticked_ms: dict[int, int] = {}   # partition -> the clock of its last tick sent

    def current_sums(self) -> UsageSums:
        """The sums for the partitions owned now, as the table holds them.

        Kept for one set of partitions and one settled state of the table (``epoch``), and
        rebuilt when either changed. During a rebalance (``epoch`` None) sums built for the
        new partitions answer but are not kept (the recovery may still change the table);
        the kept ones serve as long as the partitions are theirs, and are rebuilt once the
        rebalance is over. See *The sums and the table*.
        """
        owned = frozenset(self.owned())
        epoch = self.epoch()
        if self.sums.partitions == owned and (epoch is None or self.sums.epoch == epoch):
            return self.sums
        sums = self._rebuild(owned, epoch)
        if epoch is not None:
            self.sums = sums
        return sums

    def partitions_to_tick(self, owned: Iterable[int], now_ms: int) -> list[int]:
        """The partitions of ``owned`` a tick at ``now_ms`` goes to (see *Closing on time*):
        those with a window due, and those not sent a tick for ``IDLE_TICK_MS``; all of
        them during a rebalance (``epoch`` None: the sums are not known yet)."""
        owned = set(owned)
        chosen = {p for p in owned if now_ms - self._ticked_ms.get(p, now_ms - IDLE_TICK_MS)
                  >= IDLE_TICK_MS}
        if chosen != owned and self.epoch() is None:
            chosen = owned
        elif chosen != owned:
            sums = self.current_sums()
            chosen |= {sums.window_partition[key] for key, (info, _c) in sums.windows.items()
                       if now_ms >= int(info[2]) + self.grace_ms} & owned
        self._ticked_ms.update(dict.fromkeys(chosen, now_ms))
        return sorted(chosen)

    def _rebuild(self, owned: frozenset[int], epoch: int | None) -> UsageSums:
        sums = UsageSums(partitions=owned, epoch=epoch)
        last_tick = {p: self._book(p).last_tick_ms for p in owned}
        for key, raw in list(self.table.items()):
            if not key.startswith("contrib/") or not raw or raw["partition"] not in owned:
                continue
            model_key = f"{raw['provider']}/{raw['model']}"
            sums.add(model_key, (raw["provider"], raw["model"]),
                     TokenCounts.from_json(raw["totals"]), Cost.from_json(raw.get("cost")))
            for row_key, share in raw.get("ledger", {}).items():
                tenant, _, start = row_key.rpartition("/")
                sums.add_row(RowId(tenant, int(start), raw["provider"], raw["model"]),
                             TokenCounts.from_json(share["counts"]),
                             Cost.from_json(share["cost"]))
            for wkey, window in raw["windows"].items():
                if last_tick[raw["partition"]] < int(window["info"][2]) + self.grace_ms:
                    sums.add_window(wkey, window["info"], raw["partition"],
                                    TokenCounts.from_json(window["counts"]))
        return sums

    def _book(self, partition: int) -> WindowBook:
        return WindowBook.from_json(self.table.get(f"book/{partition}"), self.grace_ms,
                                    self.sizes)

    async def handle(self, partition: int, value: Mapping[str, Any]) -> None:
        await self.handle_batch(partition, (value,))

    async def handle_batch(self, partition: int, values: Iterable[Mapping[str, Any]]) -> None:
        """Fold samples and ticks of one partition in order; each exported key is published
        once per batch, with its last value (the export topic is compacted)."""
        pending: dict[str, dict[str, JsonValue]] = {}
        book = self._book(partition)
        # The batch's records are folded without an await, so the owned partitions and the
        # table's epoch cannot change in between: the sums are looked up once per batch.
        sums = self.current_sums()
        for value in values:
            if TICK in value:
                self._tick(sums, partition, book, int(value[TICK]), pending)
            else:
                self._sample(sums, partition, book, UsageSample.from_json(value), pending)
        for key, record in pending.items():
            await self._publish(key, record)

    def _tick(self, sums: UsageSums, partition: int, book: WindowBook, now_ms: int,
              pending: dict[str, dict[str, JsonValue]]) -> None:
        book.last_tick_ms = max(book.last_tick_ms, now_ms)
        due = [key for key, (info, _c) in sums.windows.items()
               if sums.window_partition[key] == partition
               and book.last_tick_ms >= int(info[2]) + self.grace_ms]
        for key in due:
            info, counts = sums.windows.pop(key)
            sums.window_partition.pop(key, None)
            pending[key] = window_record(info, counts, closed=True)
            self.counters.windows_closed += 1
        self.table[f"book/{partition}"] = {"lastTickMs": book.last_tick_ms, "open": {}}

    def _sample(self, sums: UsageSums, partition: int, book: WindowBook, sample: UsageSample,
                pending: dict[str, dict[str, JsonValue]]) -> None:
        """Fold one sample: its record is written first, then the sums follow it. A write
        that raises leaves both as they were (the batch is folded again, and the sample
        counted once); sums updated first kept it twice."""
        key = f"contrib/{sample.model_key}/{sample.session_id}"
        raw = self.table.get(key)
        if raw is not None and int(raw["seq"]) >= sample.seq:
            self.counters.usage_duplicates += 1
            return
        accepted, late = book.windows_for(sample)
        windows = {wkey: window for wkey, window in (raw or {}).get("windows", {}).items()
                   if book.last_tick_ms < int(window["info"][2]) + self.grace_ms}
        for wkey in accepted:
            mine = TokenCounts.from_json(windows.get(wkey, {}).get("counts", {}))
            windows[wkey] = {"info": book.open[wkey],
                             "counts": (mine + sample.counts).to_json()}
        if late:
            self.counters.late_window_samples += 1
            log.warning("late usage sample (session %s seq %d, time %d) for closed windows %s: "
                        "kept in totals, not in the windows", sample.session_id, sample.seq,
                        sample.time, ", ".join(late))
        cost = self.prices.cost(sample.provider, sample.model, sample.time, sample.counts)
        row = RowId.of(sample)
        mine_total = TokenCounts.from_json((raw or {}).get("totals", {})) + sample.counts
        mine_cost = Cost.from_json((raw or {}).get("cost")) + cost
        self.table[key] = {"provider": sample.provider, "model": sample.model,
                           "session": sample.session_id, "partition": partition,
                           "seq": sample.seq, "totals": mine_total.to_json(),
                           "cost": mine_cost.to_json(), "windows": windows,
                           "ledger": self._ledger_share(row, sample.counts, cost,
                                                        (raw or {}).get("ledger", {}))}
        for wkey in accepted:
            info = book.open[wkey]
            total = sums.add_window(wkey, info, partition, sample.counts)
            pending[wkey] = window_record(info, total, closed=False)
        model_total, model_cost = sums.add(sample.model_key, (sample.provider, sample.model),
                                           sample.counts, cost)
        pending[f"model/{sample.model_key}"] = model_record(
            sample.provider, sample.model, model_total, model_cost.record_fields())
        row_counts, row_cost = sums.add_row(row, sample.counts, cost)
        pending[row.key] = ledger_record(row, row_counts, row_cost)

    @staticmethod
    def _ledger_share(row: RowId, counts: TokenCounts, cost: Cost, held: Mapping[str, Any]
                      ) -> dict[str, Any]:
        """The session's ledger shares with a sample of ``row`` added (a new dict: the held
        one is the table's value)."""
        share_key = f"{row.tenant}/{row.start_ms}"
        share = held.get(share_key, {})
        ledger = dict(held)
        ledger[share_key] = {
            "counts": (TokenCounts.from_json(share.get("counts", {})) + counts).to_json(),
            "cost": (Cost.from_json(share.get("cost")) + cost).to_json()}
        return ledger

    def model_records(self) -> list[dict[str, JsonValue]]:
        sums = self.current_sums()
        return [model_record(*sums.model_names[key], counts,
                             sums.model_costs.get(key, Cost()).record_fields())
                for key, counts in sorted(sums.models.items())]

    def ledger_records(self) -> list[dict[str, JsonValue]]:
        """The ledger rows of the partitions this worker owns, by key."""
        sums = self.current_sums()
        return [ledger_record(row, counts, cost)
                for row, (counts, cost) in sorted(sums.ledger.items(), key=lambda i: i[0].key)]

    async def _publish(self, key: str, value: dict[str, JsonValue]) -> None:
        await self.send(OutRecord(self.export_topic, key.encode(),
                                 self.outputs.usage.encode(value)))
