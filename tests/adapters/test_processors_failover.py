"""Failover: nothing is committed past a table write the broker has not acknowledged.

faust writes table changes to their changelogs through its producer buffer (``send_soon``)
and flushes the producer before committing offsets; faust's own flush can return with those
writes still unsent (its buffer drain gives up after 0.1 s without a send), and a kill -9
right after that commit leaves the survivor's recovered table behind the committed offset.
The worker's producer (:class:`FlushingProducer`) must wait for every such write.
"""

from __future__ import annotations

import asyncio
from typing import Any

import faust
import pytest
from processors_support import fresh_settings

from pipeline.adapters.faust.flushing import FlushingProducer
from pipeline.adapters.faust.transport import use_batching_transport
from pipeline.adapters.kafka.topic_scan import ensure_topic
from pipeline.settings import Settings

pytestmark = pytest.mark.broker


async def _flush_while_writes_cannot_go_out_yet(settings: Settings) -> tuple[int, list[Any]]:
    """Buffer writes to a topic that appears only after ``flush()`` began (a send that
    takes longer than faust's 0.1 s drain), then flush; how many writes were still unsent
    when the flush returned, and the writes' futures."""
    app = faust.App(f"{settings.topic_prefix}failover",
                    broker=f"kafka://{settings.bootstrap_servers}", producer_acks=-1,
                    key_serializer="raw", value_serializer="raw", autodiscover=False)
    use_batching_transport(app, [], fetch_max_wait_ms=20)
    assert isinstance(app.producer, FlushingProducer)
    name = f"{settings.topic_prefix}changelog-like"
    changelog = app.topic(name, key_type=bytes, value_type=bytes)
    await app.producer.start()
    try:
        writes = [changelog.send_soon(key=b"session", value=b"state %d" % i) for i in range(3)]

        async def create_later() -> None:
            await asyncio.sleep(0.5)
            await ensure_topic(settings, name, compact=True)

        creating = asyncio.get_running_loop().create_task(create_later())
        await app.producer.flush()
        unsent = sum(not w.done() for w in writes)
        await creating
        return unsent, list(writes)
    finally:
        await app.producer.stop()


def test_flush_returns_only_once_every_buffered_table_write_is_acknowledged(
        kafka_bootstrap: str) -> None:
    unsent, writes = asyncio.run(
        _flush_while_writes_cannot_go_out_yet(fresh_settings(kafka_bootstrap)))
    assert unsent == 0, f"flush returned with {unsent} of {len(writes)} writes unsent"
    offsets = [w.result().offset for w in writes]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(writes)
