"""The worker's producer: ``flush`` returns only when every buffered write is acknowledged.

Rules:

- :meth:`FlushingProducer.flush` returns once every write put in faust's producer buffer
  before the call (table changelogs go through ``send_soon``) is acknowledged by the broker,
  and raises when one failed, at this flush and every later one: nothing is committed past
  a lost write. Writes made during the flush are not waited for.
- Every write lingers at least ``MIN_LINGER_MS`` (more when faust's ``producer_linger``
  asks for it), so that small batches' writes share produce requests.
- :class:`DirectTopic` hands a write to the running producer without faust's per-write
  start-up guard.
- The producer is idempotent (``enable_idempotence``, acks from all in-sync replicas): a
  produce request retried after its response was lost (a connection reset) is written once.
  Without it, a dead letter (whose topic keeps every record) was written twice.

Why (faust's flush gives up after 0.1 s; the measurements): docs/decisions/processors-transport.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Final

import faust
from faust.transport.drivers.aiokafka import Producer as AIOKafkaProducer

log = logging.getLogger(__name__)

FLUSH_SLICE_S: Final = 1.0
FLUSH_WARN_EVERY_S: Final = 30.0
# See the module doc (measured: linger 0 -> p99 0.75-3.3 s, 2 ms -> 0.12 s).
MIN_LINGER_MS: Final = 2


class FlushingProducer(AIOKafkaProducer):
    """faust's aiokafka producer whose ``flush`` waits for every write put in its buffer
    (table changelogs go through ``send_soon``) to be acknowledged, not only for the ones
    aiokafka holds at that moment (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unacknowledged: set[asyncio.Future[Any]] = set()
        self.linger_ms = max(self.linger_ms, MIN_LINGER_MS)   # read by the aiokafka producer

    def _settings_extra(self) -> Any:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}

    def send_soon(self, fut: Any) -> None:
        self._unacknowledged.add(fut)
        fut.add_done_callback(self._acknowledged)
        super().send_soon(fut)

    def _acknowledged(self, fut: asyncio.Future[Any]) -> None:
        # A failed write stays, so that every later flush (and commit) raises.
        if fut.cancelled() or fut.exception() is None:
            self._unacknowledged.discard(fut)

    async def flush(self) -> None:
        """Return once every write put in the buffer before this call is acknowledged.

        Only those: writes made meanwhile belong to batches acked after the commit that
        called this began, and under steady load waiting for *all* writes would hold every
        commit back until a lull (measured: commits 5 s late at a 2.8 s interval)."""
        await super().flush()
        waiting = {fut for fut in self._unacknowledged if not fut.done()}
        started = last_warning = time.monotonic()
        while waiting:
            # Wait in slices and flush again between them: faust's buffer drain gives up
            # after 0.1 s, so writes buffered meanwhile (other agents) would otherwise wait
            # for a drain nobody starts. A failed write raises; a slow broker is logged.
            done, waiting = await asyncio.wait(waiting, timeout=FLUSH_SLICE_S)
            for fut in done:
                if not fut.cancelled() and fut.exception() is not None:
                    raise fut.exception()  # type: ignore[misc]
            if time.monotonic() - last_warning > FLUSH_WARN_EVERY_S:
                last_warning = time.monotonic()
                log.warning("%d table/output writes unacknowledged for %.0f s; offsets are "
                            "not committed until they are", len(waiting),
                            last_warning - started)
            if waiting:
                await super().flush()
        failed = [fut for fut in self._unacknowledged if fut.done()]
        for fut in failed:   # a write that failed before this flush: never commit past it
            if not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]


class DirectTopic(faust.Topic):
    """faust's topic, handing a write to the running producer without faust's stampede guard.

    Every table write waits in faust's producer buffer, whose single task sends one write at
    a time through ``Topic.publish_message``, which asks ``app.maybe_start_producer()`` for
    the producer each time: a ``stampede``-wrapped coroutine that yields to the event loop
    three times (``asyncio.sleep(0)``) even when the producer runs. The buffer then drained
    a few hundred writes per second while the folds queued thousands; past
    ``producer_buffer`` faust stops fetching until it drained (measured at 5,000 events/s:
    the buffer at 5,000 writes and fetches stalled for 0.3-0.9 s, the whole latency tail;
    p99 append -> derived change 0.8-1.2 s before, 0.18 s after).
    """

    async def _get_producer(self) -> Any:
        app = self.app
        if not app.in_transaction:
            producer = app.producer
            if producer.started:
                return producer
        return await super()._get_producer()
