"""The processors fold only committed records: the drivers write the session topic in
transactions, and an aborted one (a fenced zombie, a crash mid-batch) holds seqs that the next
owner writes again with other content. Folding it would make the committed events look like
duplicates and the tables would hold what no reader of the log sees."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from processors_support import Worker, event_records, free_port, generated_sessions

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.core.events import Event
from pipeline.services.processors.verify import verify_processors
from pipeline.settings import Settings

pytestmark = pytest.mark.broker


@pytest.fixture()
def stack(kafka_bootstrap: str, tmp_path: Path) -> Iterator[tuple[Settings, Worker]]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap, topic_prefix=prefix,
                                 partitions=1, replication_factor=1,
                                 group_id_prefix=f"{prefix}g-")
    asyncio.run(ensure_topics(settings))
    worker = Worker(settings, free_port(), tmp_path)
    try:
        worker.wait_ready()
        yield settings, worker
    finally:
        worker.stop()


def rewritten(events: list[Event]) -> list[Event]:
    """The same seqs and types with other content: what an aborted zombie batch may hold."""
    def other(event: Event) -> Event:
        if event.type == "user/message":
            return dataclasses.replace(event, data={
                **event.data, "content": [{"type": "text", "text": "never committed"}]})
        return event
    return [other(e) for e in events]


async def send_aborted(settings: Settings, records: list[OutRecord]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers,
                                transactional_id=f"zombie-{uuid.uuid4().hex[:8]}",
                                enable_idempotence=True)
    await producer.start()
    try:
        await producer.begin_transaction()
        for record in records:
            await producer.send_and_wait(record.topic, record.value, key=record.key,
                                         headers=list(record.headers))
        await producer.abort_transaction()
    finally:
        await producer.stop()


async def test_records_of_an_aborted_transaction_are_never_folded(
        stack: tuple[Settings, Worker]) -> None:
    settings, worker = stack
    sessions = generated_sessions(11, 3, "iso", ["model-a"], int(time.time() * 1000))
    # the aborted batch comes first, at the offsets a reader would meet first
    zombie = [r for sid, events in sessions.items()
              for r in event_records(settings, sid, rewritten(events[:12]))]
    await send_aborted(settings, zombie)
    await send_records(settings, [r for sid, events in sessions.items()
                                  for r in event_records(settings, sid, events)])
    report = await verify_processors(worker.url(""), sessions, timeout_s=60)
    assert report.ok, (report.problems, worker.tail())
    _status, health = worker.get("/health")
    assert health["counters"]["duplicates"] == 0, health["counters"]
