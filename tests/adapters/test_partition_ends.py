"""The lag probe's two ends of a partition on the real broker: records of a transaction not
ended yet lie between the last stable offset and the high watermark, and leave that gap
once it commits (the gauges and the alert ``DshTransactionHanging`` are built on this)."""

from __future__ import annotations

import asyncio
import time
import uuid

from aiokafka import AIOKafkaProducer

from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.topic_scan import ensure_topic
from pipeline.adapters.metrics.consumer_lag import ConsumerLagProbe, PartitionEnds
from pipeline.settings import Settings


async def ends_of(probe: ConsumerLagProbe) -> list[PartitionEnds]:
    """The ends a sample reads beside the lag (no group reads these topics here)."""
    await probe.sample(int(time.time() * 1000))
    return probe.ends


async def test_an_open_transaction_shows_as_records_above_the_last_stable_offset(
        settings: Settings) -> None:
    topic = f"{settings.topic_prefix}ends-{uuid.uuid4().hex[:8]}"
    await ensure_topic(settings, topic, compact=False)
    writer = AIOKafkaProducer(**client_options(settings), enable_idempotence=True,
                              transactional_id=f"ends-{uuid.uuid4().hex[:8]}")
    probe = ConsumerLagProbe(settings, [topic])
    await writer.start()
    await probe.start()
    try:
        # the first sample only learns which partitions have a leader (a leader just elected
        # may still refuse the lookup): they are read from the next sample on
        assert await ends_of(probe) == []
        await writer.begin_transaction()
        for _ in range(4):
            await writer.send_and_wait(topic, b"event", key=b"s", partition=0)
        ends = {(e.topic, e.partition): e for e in await ends_of(probe)}
        assert set(ends) == {(topic, p) for p in range(settings.partitions)}
        open_one = ends[(topic, 0)]
        assert open_one.stable == 0 and open_one.high == 4 and open_one.unstable == 4
        assert all(ends[(topic, p)] == PartitionEnds(topic, p, 0, 0)
                   for p in range(1, settings.partitions))
        await writer.commit_transaction()
        # the commit's markers are written after the commit returns: poll until they are
        for _ in range(100):
            (after,) = [e for e in await ends_of(probe) if e.partition == 0]
            if after.unstable == 0:
                break
            await asyncio.sleep(0.1)
        assert after.unstable == 0 and after.stable == after.high == 5   # and its marker
    finally:
        await probe.stop()
        await writer.stop()


async def test_before_start_the_probe_reads_nothing(settings: Settings) -> None:
    assert await ends_of(ConsumerLagProbe(settings, [settings.topics.inbox])) == []
