"""The 3-node local cluster: kill -9 of one node while producing with acks=all loses no
acknowledged record, and the two survivors keep accepting and serving writes."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from dsh_dev.localstack.kafka import KafkaLocal

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

TOPIC = "cluster.acks-all"
PARTITIONS = 3
BATCHES = 12
BATCH_SIZE = 100
KILL_AFTER_BATCH = 4


async def _create_topic(bootstrap: str) -> int:
    """Create the RF-3 test topic; return the node leading partition 0 (the one to kill)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, PARTITIONS, 3)])
        for _ in range(100):
            described = await admin.describe_topics([TOPIC])
            partitions = described[0]["partitions"] if described[0]["error_code"] == 0 else []
            if len(partitions) == PARTITIONS and all(p["leader"] >= 0 for p in partitions):
                by_id = {p["partition"]: p for p in partitions}
                assert all(len(p["isr"]) == 3 for p in partitions)
                return int(by_id[0]["leader"])
            await asyncio.sleep(0.1)
        raise AssertionError(f"{TOPIC} never got leaders for all partitions")
    finally:
        await admin.close()


async def _produce(producer: AIOKafkaProducer, batch: int) -> tuple[list[bytes], int]:
    """Send one batch; return the values acknowledged and the number refused."""
    values = [f"b{batch}-r{i}".encode() for i in range(BATCH_SIZE)]
    futures = [await producer.send(TOPIC, v, key=v) for v in values]
    results = await asyncio.gather(*futures, return_exceptions=True)
    acked = [v for v, r in zip(values, results, strict=True) if not isinstance(r, BaseException)]
    return acked, len(values) - len(acked)


async def _read_all(bootstrap: str) -> list[bytes]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = [TopicPartition(TOPIC, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        values: list[bytes] = []
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=2_000)).values():
                values += [r.value for r in records]
        return values
    finally:
        await consumer.stop()


async def _scenario(cluster: KafkaLocal) -> None:
    victim = await _create_topic(cluster.bootstrap)
    producer = AIOKafkaProducer(bootstrap_servers=cluster.bootstrap, acks="all",
                                enable_idempotence=True, request_timeout_ms=30_000)
    await producer.start()
    acked: list[bytes] = []
    acked_after_kill = refused_after_kill = 0
    try:
        for batch in range(BATCHES):
            if batch == KILL_AFTER_BATCH:
                os.kill(cluster.pid(victim), signal.SIGKILL)
            ok, refused = await _produce(producer, batch)
            acked += ok
            assert batch >= KILL_AFTER_BATCH or refused == 0, "refusals before any failure"
            if batch >= KILL_AFTER_BATCH:
                acked_after_kill += len(ok)
                refused_after_kill += refused
    finally:
        await producer.stop()
    assert not cluster.alive(victim)
    survivors = ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes if n.node_id != victim)
    read = await _read_all(survivors)
    lost = set(acked) - set(read)
    assert not lost, f"{len(lost)} acknowledged records lost, e.g. {sorted(lost)[:3]}"
    # The survivors kept serving: (nearly) every write after the kill was acknowledged.
    assert acked_after_kill >= (BATCHES - KILL_AFTER_BATCH - 1) * BATCH_SIZE, (
        acked_after_kill, refused_after_kill)


def test_kill9_of_one_node_loses_no_acknowledged_record(cluster: KafkaLocal) -> None:
    assert len(cluster.nodes) == 3 and all(cluster.alive(n.node_id) for n in cluster.nodes)
    asyncio.run(_scenario(cluster))
