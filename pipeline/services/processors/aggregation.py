"""Usage per provider/model and per time window, on the internal topic keyed by model.

Sessions of one model live in every partition of the session topic, so per-model aggregates
cannot be table entries of the session stage (a key written from two partitions would land in
two changelog partitions). The session stage therefore sends each usage sample to an internal
topic keyed by ``provider/model``; this stage owns every model key of its partitions, with
changelogs co-partitioned with that topic.

Windows close on wall-clock time: a timer in each worker sends a *tick* (its clock reading) to
every partition of the internal topic it owns, and the tick is folded here like any record, so
closing is decided inside the stream and its table writes go to the right changelog partition
(faust refuses table writes from a timer). A sample whose window was already closed by a tick
is late: counted in the totals, reported (counter + log), not added to the closed window.

Duplicates (a sample re-sent after a crash of the session stage) are skipped by the last seq
applied per (model, session).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from pipeline.core.events import JsonValue
from pipeline.core.usage import (
    TokenCounts,
    UsageSample,
    WindowBook,
    model_record,
    window_record,
)
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.folding import Outgoing, Send, Table, json_bytes

log = logging.getLogger(__name__)

TICK: Final = "tick"


def tick_value(now_ms: int) -> bytes:
    return json_bytes({TICK: now_ms}) or b""


class UsageAggregator:
    """Folds samples and ticks of one worker's partitions of the usage-by-model topic."""

    def __init__(self, table: Table, send: Send, usage_topic: str, counters: DeliveryCounters,
                 *, grace_ms: int, sizes: Mapping[str, int]) -> None:
        self.table = table
        self.send = send
        self.usage_topic = usage_topic
        self.counters = counters
        self.grace_ms = grace_ms
        self.sizes = sizes

    def _book(self, partition: int) -> WindowBook:
        return WindowBook.from_json(self.table.get(f"book/{partition}"), self.grace_ms,
                                    self.sizes)

    async def handle(self, partition: int, value: Mapping[str, Any]) -> None:
        if TICK in value:
            await self._tick(partition, int(value[TICK]))
        else:
            await self._sample(partition, UsageSample.from_json(value))

    async def _tick(self, partition: int, now_ms: int) -> None:
        book = self._book(partition)
        for key, info in book.tick(now_ms):
            counts = TokenCounts.from_json(self.table.get(key) or {})
            await self._publish(key, window_record(info, counts, closed=True))
            self.table.pop(key, None)
            self.counters.windows_closed += 1
        self.table[f"book/{partition}"] = book.to_json()

    async def _sample(self, partition: int, sample: UsageSample) -> None:
        seen_key = f"seen/{sample.model_key}/{sample.session_id}"
        if int(self.table.get(seen_key, -1)) >= sample.seq:
            self.counters.usage_duplicates += 1
            return
        book = self._book(partition)
        accepted, late = book.windows_for(sample)
        for key in accepted:
            counts = TokenCounts.from_json(self.table.get(key) or {}) + sample.counts
            self.table[key] = counts.to_json()
            await self._publish(key, window_record(book.open[key], counts, closed=False))
        if late:
            self.counters.late_window_samples += 1
            log.warning("late usage sample (session %s seq %d, time %d) for closed windows %s: "
                        "kept in totals, not in the windows", sample.session_id, sample.seq,
                        sample.time, ", ".join(late))
        model_key = f"model/{sample.model_key}"
        raw = self.table.get(model_key)
        totals = (TokenCounts.from_json(raw) if raw else TokenCounts()) + sample.counts
        self.table[model_key] = {**totals.to_json(), "partition": partition}
        await self._publish(model_key, model_record(sample.provider, sample.model, totals))
        self.table[f"book/{partition}"] = book.to_json()
        self.table[seen_key] = sample.seq

    async def _publish(self, key: str, value: dict[str, JsonValue]) -> None:
        await self.send(Outgoing(self.usage_topic, key.encode(), json_bytes(value)))
