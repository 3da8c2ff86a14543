"""The worker's consumer thread: short broker polls, and the exact offset span of each batch.

What it works around and why is in :mod:`.transport` (*What a batch covers*, *Records
fetched for a paused partition*) and in the comments below, each with what was measured.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer

PREFETCH_BACKOFF_S: Final = 0.005   # see ShortPollConsumerThread.on_start
# faust takes a partition out of its active set while its agent's stream buffer is nearly
# full and puts it back when the buffer drained; records aiokafka buffered for it meanwhile
# raise no new fetch event, so a fetch waiting for one slept until faust's 1 s timeout
# (measured: fetch gaps of 0.5-1 s with the worker idle, the rest of the tail). The wait
# looks at the active set again every RESUME_POLL_S instead.
RESUME_POLL_S: Final = 0.005
# aiokafka's fetch routine waits for a fetch to return, records to be taken or this much
# (its ``consumer_timeout_ms``, 0.2 s by default) before it looks for a fetch to send. With
# a fetch due it sometimes slept the whole 0.2 s (measured at 5,000 events/s: 200 ms with
# no fetch in flight, 2-3 times in a 10 s run, the whole p99); it looks again every 10 ms.
FETCH_ROUTINE_POLL_S: Final = 0.01


class ShortPollConsumerThread(AIOKafkaConsumerThread):
    """faust's consumer thread, with the broker's fetch long-poll capped at
    ``BatchingTransport.fetch_max_wait_ms`` instead of faust's fixed 1,500 ms, and a fetch
    answered once ``BatchingTransport.fetch_min_bytes`` are ready (faust passes neither).

    aiokafka keeps ONE fetch in flight per broker, for the partitions that have no unread
    records. A fetch that went out for idle partitions (the usage-by-model topic, a quiet
    session partition) holds every other partition of that broker until it returns: with
    faust's 1.5 s that adds up to 1.5 s to the latency of a busy partition.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Every position move (partition, start, end) since the consumer last took them:
        # the spans of the records handed out, and of drains that handed out none.
        self.moves: list[tuple[Any, int, int]] = []

    async def _fetch_records(self, consumer: Any, active_partitions: Any,
                             timeout: float | None = None, max_records: int | None = None
                             ) -> Any:
        """faust's fetch, recording the position of each partition right before and right
        after aiokafka hands its records out (see *What a batch covers*): nothing runs in
        between, the hand-out being synchronous once records are buffered."""
        if not self.consumer.flow_active:
            return {}
        fetcher = consumer._fetcher
        if consumer._closed or fetcher._closed:
            raise AIOKafkaConsumer.consumer_stopped_errors[0]()
        with fetcher._subscriptions.fetch_context():
            deadline = time.monotonic() + (timeout or 0.0)
            while True:
                if fetcher._subscriptions.reassignment_in_progress:
                    await fetcher._subscriptions.wait_for_assignment()
                before = _positions(fetcher)
                records = await fetcher.fetched_records(active_partitions, timeout=0,
                                                        max_records=max_records)
                self.moves += _moves(before, _positions(fetcher))
                if records:
                    return records
                # In slices: a partition faust resumes meanwhile (its stream buffer drained
                # below the low mark) may have records buffered already, and nothing
                # else wakes this wait for them (see RESUME_POLL_S).
                left = deadline - time.monotonic()
                if left <= 0:
                    return {}
                await _wait_for_fetch(fetcher, min(left, RESUME_POLL_S))
                if fetcher._closed:
                    return {}

    async def on_start(self) -> None:
        await super().on_start()
        # aiokafka holds back a broker's next fetch, for ALL its partitions, while any
        # partition has fetched records nobody took, for up to its ``prefetch_backoff``
        # (0.1 s, not a consumer option). faust never takes the records of the assigned
        # partitions it does not read (the changelogs of its own active tables, which this
        # worker writes all the time): every batch of changelog writes fetched stalled the
        # session partitions for 0.1 s (measured: fetch gaps of ~100 ms every ~150 ms at
        # 5,000 events/s, most of the latency tail). Records not taken are not fetched
        # again until they are, so a short hold costs nothing but the stall.
        consumer: Any = self._consumer
        consumer._fetcher._prefetch_backoff = PREFETCH_BACKOFF_S

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # Read by the fetcher that ``start()`` creates; faust passes no way to set it.
        consumer._fetch_max_wait_ms = transport.fetch_max_wait_ms
        consumer._fetch_min_bytes = transport.fetch_min_bytes
        consumer._consumer_timeout = FETCH_ROUTINE_POLL_S
        # faust reads committed only under its own exactly-once; the session topic is
        # written in the drivers' transactions, and an aborted one (a fenced zombie, a crash
        # mid-batch) must never be folded: its seqs are written again by the next owner.
        consumer._isolation_level = "read_committed"
        return consumer


def _positions(fetcher: Any) -> dict[Any, int | None]:
    """aiokafka's position of every assigned partition (None: not yet known)."""
    subscription = fetcher._subscriptions.subscription
    assignment = subscription.assignment if subscription is not None else None
    if assignment is None:
        return {}
    return {tp: assignment.state_value(tp)._position for tp in assignment.tps}


def _moves(before: dict[Any, int | None], after: dict[Any, int | None]
           ) -> list[tuple[Any, int, int]]:
    found = []
    for tp, end in after.items():
        start = before.get(tp)
        if start is not None and end is not None and end > start:
            found.append((tp, start, end))
    return found


async def _wait_for_fetch(fetcher: Any, timeout: float) -> bool:
    """Until aiokafka buffered new records (True) or ``timeout`` passed (False)."""
    if timeout <= 0:
        return False
    waiter = fetcher._create_fetch_waiter()
    done, pending = await asyncio.wait([waiter], timeout=timeout)
    for future in pending:
        future.cancel()
    if not done or fetcher._closed:
        return False
    waiter.result()   # raises what the fetch routine failed with (authorization, ...)
    return True


class AskedPartitions:
    """The consumer's live set of active partitions as aiokafka is asked for it.

    aiokafka returns the records of *every* assigned partition when the set it is given is
    empty (its test is ``if partitions and tp not in partitions``), and faust passes its
    live set, which empties while every partition is paused (a rebalance, table recovery):
    the records of paused partitions would be handed out, their position moved past them,
    and faust would drop them. Never empty to aiokafka's eyes, this view makes it keep them.
    """

    __slots__ = ("_live",)

    def __init__(self, live: Any) -> None:
        self._live = live

    def __bool__(self) -> bool:
        return True

    def __contains__(self, tp: object) -> bool:
        return tp in self._live

    def __iter__(self) -> Any:
        return iter(list(self._live))

    def __len__(self) -> int:
        return len(self._live)
