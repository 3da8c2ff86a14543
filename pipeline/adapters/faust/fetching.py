"""The worker's consumer thread: short broker polls, and the exact offset span of each batch.

Rules it keeps (the measurements behind each: docs/decisions/processors-transport.md):

- The broker's fetch long-poll is ``BatchingTransport.fetch_max_wait_ms`` and a fetch is
  answered once ``fetch_min_bytes`` are ready; the session topic is read committed only.
  These are aiokafka's public consumer options: the worker consumer is built with faust's
  options plus these (:func:`worker_consumer_options`), and records are taken with
  aiokafka's public ``getmany``.
- Every move of a partition's position while records are handed out is recorded as a span
  ``(partition, start, end)`` (:attr:`ShortPollConsumerThread.moves`): the hand-out is
  synchronous once records are buffered, so the span is exactly what the batch covers,
  transaction markers and aborted records included.
- aiokafka is asked for the partitions active at the moment of each hand-out, never for
  an empty set (:func:`_asked`): it would hand out those of paused partitions.
- A fetch wait re-checks the active set every ``RESUME_POLL_S`` and the fetch routine
  looks for a fetch to send every ``FETCH_ROUTINE_POLL_S``; fetched records nobody takes
  hold the broker's next fetch for at most ``PREFETCH_BACKOFF_S``.
- Two paces (:class:`FetchPace`): the busy one above while records arrive, the idle one
  once none arrived for ``IDLE_AFTER_S``: a long-poll of ``IDLE_FETCH_MAX_WAIT_MS``
  answered by the first byte (so the first record after a lull is fetched at once), and
  slower re-checks. New records switch back to the busy pace before aiokafka sends its next
  fetch: aiokafka holds a broker's next fetch while fetched records wait untaken (up to
  ``PREFETCH_BACKOFF_S``), and the switch is made when they are taken or first seen.

Private names of faust and aiokafka are reached through :mod:`.private_api` only.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Final

import aiokafka
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from faust.exceptions import ImproperlyConfigured
from faust.transport.drivers.aiokafka import (
    AIOKafkaConsumerThread,
    credentials_to_aiokafka_auth,
    ensure_aiokafka_TP,
    server_list,
)
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer

from pipeline.adapters.faust import private_api

PREFETCH_BACKOFF_S: Final = 0.005   # aiokafka: 0.1 s, not a consumer option
RESUME_POLL_S: Final = 0.005
FETCH_ROUTINE_POLL_S: Final = 0.01   # aiokafka: consumer_timeout_ms, 0.2 s
# The idle pace: no new records for IDLE_AFTER_S.
IDLE_AFTER_S: Final = 0.1
IDLE_FETCH_MAX_WAIT_MS: Final = 500
IDLE_RESUME_POLL_S: Final = 0.05
# aiokafka's fetch routine is woken by every fetch answer, records taken, assignment and
# metadata change; its poll only matters when none is in flight: once per idle long-poll.
IDLE_FETCH_ROUTINE_POLL_S: Final = IDLE_FETCH_MAX_WAIT_MS / 1000


@dataclass(frozen=True, slots=True)
class FetchPace:
    """How the consumer thread fetches: the broker's long-poll and minimum answer size, how
    often aiokafka's fetch routine looks for a fetch to send, and how often a fetch wait
    re-checks the active partitions."""

    max_wait_ms: int
    min_bytes: int
    routine_poll_s: float
    resume_poll_s: float


def busy_pace(transport: Any) -> FetchPace:
    """The transport's fetch options (short polls: see the module doc)."""
    return FetchPace(transport.fetch_max_wait_ms, transport.fetch_min_bytes,
                     FETCH_ROUTINE_POLL_S, RESUME_POLL_S)


def idle_pace(transport: Any) -> FetchPace:
    """Long polls answered by the first byte: the first record after a lull is fetched at
    once, and an idle worker is not woken 200 times a second."""
    return FetchPace(max(IDLE_FETCH_MAX_WAIT_MS, transport.fetch_max_wait_ms), 1,
                     IDLE_FETCH_ROUTINE_POLL_S, IDLE_RESUME_POLL_S)


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
        self.worker_consumer: Any = None   # the aiokafka consumer, once built
        self._paces = (busy_pace(self.transport), idle_pace(self.transport))
        self.pace = self._paces[0]   # the consumer is built with the busy pace
        self._new_records_at = time.monotonic()

    async def _fetch_records(self, consumer: Any, active_partitions: Any,
                             timeout: float | None = None, max_records: int | None = None
                             ) -> Any:
        """faust's fetch through aiokafka's public ``getmany``, asking for the partitions
        active at that moment only, and recording the position of each partition right
        before and right after aiokafka hands its records out."""
        if not self.consumer.flow_active:
            return {}
        fetcher = private_api.fetcher_of(consumer)
        if private_api.fetcher_closed(fetcher):
            raise AIOKafkaConsumer.consumer_stopped_errors[0]()
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            # Bounded like the rest of the call: a group that never finishes rejoining (a
            # worker stopping after a crash) must not hold the thread's stop for ever.
            if not await private_api.wait_for_reassignment(fetcher, deadline - time.monotonic()):
                return {}
            asked = _asked(active_partitions, consumer)
            if asked is not None:
                before = private_api.positions(fetcher, asked)
                records = await consumer.getmany(*asked, timeout_ms=0,
                                                 max_records=max_records)
                self.moves += _moves(before, private_api.positions(fetcher, asked))
                if records:
                    self._new_records(fetcher)
                    return records
            # In slices: a partition faust resumes meanwhile may have records buffered
            # already, and nothing else wakes this wait for them.
            left = deadline - time.monotonic()
            if left <= 0:
                return {}
            self._set_pace(fetcher, idle=time.monotonic() - self._new_records_at
                           > IDLE_AFTER_S)
            if await _wait_for_fetch(fetcher, min(left, self.pace.resume_poll_s)):
                self._new_records(fetcher)
            if private_api.fetcher_closed(fetcher):
                return {}

    def _new_records(self, fetcher: Any) -> None:
        """Records arrived: the busy pace, set before aiokafka's fetch routine sends its
        next fetch (it holds it while fetched records wait untaken, see the module doc)."""
        self._new_records_at = time.monotonic()
        self._set_pace(fetcher, idle=False)

    def _set_pace(self, fetcher: Any, *, idle: bool) -> None:
        pace = self._paces[idle]
        if pace is not self.pace:
            self.pace = pace
            private_api.set_fetch_pace(fetcher, max_wait_ms=pace.max_wait_ms,
                                       min_bytes=pace.min_bytes,
                                       routine_poll_s=pace.routine_poll_s)

    async def on_start(self) -> None:
        await super().on_start()
        # faust never takes the fetched records of its own active tables' changelogs; a
        # short hold of the next fetch costs nothing but the stall.
        if self.worker_consumer is not None:
            private_api.set_prefetch_backoff(self.worker_consumer, PREFETCH_BACKOFF_S)

    def _create_worker_consumer(self, transport: Any) -> Any:
        """faust's worker consumer, built with the fetch options faust passes none of
        (aiokafka's public constructor options, :func:`worker_consumer_options`)."""
        self.worker_consumer = aiokafka.AIOKafkaConsumer(
            **worker_consumer_options(self.app, transport))
        return self.worker_consumer


def worker_consumer_options(app: Any, transport: Any) -> dict[str, Any]:
    """The options faust 0.15.3 builds its worker consumer with
    (``AIOKafkaConsumerThread._create_worker_consumer``), with the transport's fetch options
    and read_committed: the session topic is written in the drivers' transactions, and an
    aborted one (a fenced zombie, a crash mid-batch) must never be folded."""
    conf = app.conf
    if conf.broker_session_timeout > conf.broker_request_timeout:
        raise ImproperlyConfigured(
            f"Setting broker_session_timeout={conf.broker_session_timeout} cannot be greater "
            f"than broker_request_timeout={conf.broker_request_timeout}")
    # Table recovery maps changelog partitions through faust's assignor.
    assignor = (app.assignor if conf.table_standby_replicas > 0 or app.tables.changelog_topics
                else RoundRobinPartitionAssignor)
    return {
        "client_id": conf.broker_client_id, "group_id": conf.id,
        "group_instance_id": conf.consumer_group_instance_id,
        "bootstrap_servers": server_list(transport.url, transport.default_port),
        "partition_assignment_strategy": [assignor], "enable_auto_commit": False,
        "auto_offset_reset": conf.consumer_auto_offset_reset,
        "max_poll_records": conf.broker_max_poll_records,
        "max_poll_interval_ms": int((conf.broker_max_poll_interval or 0) * 1000.0),
        "max_partition_fetch_bytes": conf.consumer_max_fetch_size,
        "request_timeout_ms": int(conf.broker_request_timeout * 1000.0),
        "check_crcs": conf.broker_check_crcs,
        "session_timeout_ms": int(conf.broker_session_timeout * 1000.0),
        "rebalance_timeout_ms": int(conf.broker_rebalance_timeout * 1000.0),
        "heartbeat_interval_ms": int(conf.broker_heartbeat_interval * 1000.0),
        "metadata_max_age_ms": conf.consumer_metadata_max_age_ms,
        "connections_max_idle_ms": conf.consumer_connections_max_idle_ms,
        **credentials_to_aiokafka_auth(conf.broker_credentials, conf.ssl_context),
        # What faust passes none of (its fetch wait is a fixed 1,500 ms):
        "fetch_max_wait_ms": busy_pace(transport).max_wait_ms,
        "fetch_min_bytes": busy_pace(transport).min_bytes,
        "consumer_timeout_ms": int(busy_pace(transport).routine_poll_s * 1000),
        "isolation_level": "read_committed",
    }


def _asked(active: Any, consumer: Any) -> list[Any] | None:
    """The partitions to ask aiokafka for: those active now (None: none are; asked for
    none, aiokafka would hand out every assigned partition's records, paused ones too)."""
    if active is None:   # faust's client-only mode: every assigned partition
        active = consumer.assignment()
    asked = [ensure_aiokafka_TP(tp) for tp in active]
    return asked or None


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
