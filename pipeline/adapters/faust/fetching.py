"""The worker's consumer thread: short broker polls, and the exact offset span of each batch.

Rules it keeps (the measurements behind each: docs/decisions/processors-transport.md):

- The broker's fetch long-poll is ``BatchingTransport.fetch_max_wait_ms`` and a fetch is
  answered once ``fetch_min_bytes`` are ready; the session topic is read committed only.
- Every move of a partition's position while records are handed out is recorded as a span
  ``(partition, start, end)`` (:attr:`ShortPollConsumerThread.moves`): the hand-out is
  synchronous once records are buffered, so the span is exactly what the batch covers,
  transaction markers and aborted records included.
- aiokafka is never asked for the records of an empty partition set
  (:class:`AskedPartitions`): it would hand out those of paused partitions.
- A fetch wait re-checks the active set every ``RESUME_POLL_S`` and the fetch routine
  looks for a fetch to send every ``FETCH_ROUTINE_POLL_S``; fetched records nobody takes
  hold the broker's next fetch for at most ``PREFETCH_BACKOFF_S``.

Private names of faust and aiokafka are reached through :mod:`.private_api` only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer

from pipeline.adapters.faust import private_api

PREFETCH_BACKOFF_S: Final = 0.005   # aiokafka: 0.1 s, not a consumer option
RESUME_POLL_S: Final = 0.005
FETCH_ROUTINE_POLL_S: Final = 0.01   # aiokafka: consumer_timeout_ms, 0.2 s


class ShortPollConsumerThread(AIOKafkaConsumerThread):
    """faust's consumer thread, with the fetch options of :class:`.transport.BatchingTransport`
    and the span of every position move recorded (see the module doc).

    aiokafka keeps ONE fetch in flight per broker, for the partitions that have no unread
    records: a long-poll for idle partitions holds every busy partition of that broker."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Every position move (partition, start, end) since the consumer last took them:
        # the spans of the records handed out, and of drains that handed out none.
        self.moves: list[tuple[Any, int, int]] = []

    async def _fetch_records(self, consumer: Any, active_partitions: Any,
                             timeout: float | None = None, max_records: int | None = None
                             ) -> Any:
        """faust's fetch, recording the position of each partition right before and right
        after aiokafka hands its records out."""
        if not self.consumer.flow_active:
            return {}
        fetcher = private_api.fetcher_of(consumer)
        if private_api.fetching_closed(consumer, fetcher):
            raise AIOKafkaConsumer.consumer_stopped_errors[0]()
        with private_api.fetch_context(fetcher):
            deadline = time.monotonic() + (timeout or 0.0)
            while True:
                await private_api.wait_for_reassignment(fetcher)
                before = private_api.positions(fetcher)
                records = await fetcher.fetched_records(active_partitions, timeout=0,
                                                        max_records=max_records)
                self.moves += _moves(before, private_api.positions(fetcher))
                if records:
                    return records
                # In slices: a partition faust resumes meanwhile may have records buffered
                # already, and nothing else wakes this wait for them.
                left = deadline - time.monotonic()
                if left <= 0:
                    return {}
                await _wait_for_fetch(fetcher, min(left, RESUME_POLL_S))
                if private_api.fetcher_closed(fetcher):
                    return {}

    async def on_start(self) -> None:
        await super().on_start()
        # faust never takes the fetched records of its own active tables' changelogs; a
        # short hold of the next fetch costs nothing but the stall.
        private_api.set_prefetch_backoff(private_api.aiokafka_consumer(self),
                                         PREFETCH_BACKOFF_S)

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # read_committed: the session topic is written in the drivers' transactions, and an
        # aborted one (a fenced zombie, a crash mid-batch) must never be folded.
        private_api.configure_fetch(consumer, max_wait_ms=transport.fetch_max_wait_ms,
                                    min_bytes=transport.fetch_min_bytes,
                                    routine_poll_s=FETCH_ROUTINE_POLL_S,
                                    isolation_level="read_committed")
        return consumer


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
    waiter = private_api.fetch_waiter(fetcher)
    done, pending = await asyncio.wait([waiter], timeout=timeout)
    for future in pending:
        future.cancel()
    if not done or private_api.fetcher_closed(fetcher):
        return False
    waiter.result()   # raises what the fetch routine failed with (authorization, ...)
    return True


class AskedPartitions:
    """The consumer's live set of active partitions as aiokafka is asked for it: never
    empty to aiokafka's eyes (given an empty set, aiokafka hands out the records of every
    assigned partition, paused ones included, and faust drops them)."""

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
