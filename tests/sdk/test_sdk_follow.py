"""The SDK's snapshot-then-live readers on the real broker, with records written all the time
the snapshot is read: the snapshot is exactly the fold of the records below its end offsets,
the changes are exactly the records from there on (none lost, none twice), and a record that
does not decode is counted, not fatal."""

from __future__ import annotations

import asyncio
from typing import Any

from fanout_support import fanout_settings

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.compacted import CompactedFollow
from pipeline.adapters.kafka.topic_scan import BulkProducer, TopicScan, topic_exists
from pipeline.codec.outputs import OutputDecoder, default_output_codecs
from pipeline.codec.records import SourcePosition, source_headers
from pipeline.core.fleet import FleetStatus
from pipeline.sdk import OutputChange, Snapshot, follow_fleet
from pipeline.settings import Settings

SESSIONS = 300
PREFILL = 30_000
HANG_GUARD_S = 120.0  # only to turn a hang into a failure; never a speed assertion


class Writer:
    """Writes fleet statuses (session ``s<i % SESSIONS>``, ``turns`` = the write's number)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.written = 0
        self.encode = default_output_codecs().fleet.encode

    async def write(self, producer: BulkProducer, count: int) -> None:
        for _ in range(count):
            n = self.written
            status = FleetStatus(f"s{n % SESSIONS}", turns=n, last_seq=n)
            await producer.send(self.settings.topics.fleet, status.session_id.encode(),
                                self.encode(status.to_json()), source_headers(0, n))
            self.written += 1
        await producer.flush()


async def test_snapshot_then_changes_with_writes_during_the_snapshot(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    await ensure_topics(settings)
    writer = Writer(settings)
    stop = asyncio.Event()
    async with BulkProducer(settings) as producer:
        await producer.send(settings.topics.fleet, b"s0", b"not an output record")
        await writer.write(producer, PREFILL)

        async def keep_writing() -> None:
            while not stop.is_set():
                await writer.write(producer, 100)
                await asyncio.sleep(0)
        writing = asyncio.create_task(keep_writing())
        try:
            snapshot, written_at_snapshot, changes = await asyncio.wait_for(
                _read(settings, writer, stop), HANG_GUARD_S)
        finally:
            stop.set()
            await writing
    assert written_at_snapshot + 1 > sum(snapshot["ends"].values()), \
        "no record was written while the snapshot was read"

    below, after = await _topic_split(settings, snapshot["ends"])
    assert snapshot["values"] == below  # exactly the fold of the records below the ends
    assert snapshot["undecodable"] == 1 and "not" in snapshot["problem"]
    positions = [(c.partition, c.offset) for c in changes]
    assert sorted(positions) == sorted((p, o) for p, o, _ in after)  # none lost or twice
    assert len(set(positions)) == len(positions)
    for change in changes:
        assert change.source == SourcePosition(0, int(change.value["turns"]))  # type: ignore


async def _read(settings: Settings, writer: Writer, stop: asyncio.Event
                ) -> tuple[dict[str, Any], int, list[OutputChange]]:
    snapshot: dict[str, Any] = {}
    written_at_snapshot = 0
    changes: list[OutputChange] = []
    total_after_stop: int | None = None
    async for item in follow_fleet(settings, decoder=OutputDecoder()):
        if isinstance(item, Snapshot):
            written_at_snapshot = writer.written
            snapshot = {"values": {k: dict(v) for k, v in item.view.values.items()},
                        "ends": dict(item.ends), "undecodable": item.view.undecodable,
                        "problem": item.view.problems[0] if item.view.problems else ""}
            continue
        changes.append(item)
        if len(changes) >= 500 and not stop.is_set():
            stop.set()
            await asyncio.sleep(0.5)  # the writer's last batch lands
            total_after_stop = writer.written + 1  # + the undecodable record
        if total_after_stop is not None and \
                sum(snapshot["ends"].values()) + len(changes) >= total_after_stop:
            break
    return snapshot, written_at_snapshot, changes


async def _topic_split(settings: Settings, ends: dict[int, int]
                       ) -> tuple[dict[str, dict[str, Any]], list[tuple[int, int, str]]]:
    """The fold of the records below ``ends`` and the records at or after them."""
    decoder = OutputDecoder()
    below: dict[str, dict[str, Any]] = {}
    after: list[tuple[int, int, str]] = []
    async with TopicScan(settings, settings.topics.fleet) as scan:
        async for batch in scan.batches():
            for record in batch:
                if record.offset >= ends[record.partition]:
                    after.append((record.partition, record.offset, str(record.key)))
                    continue
                if record.value == b"not an output record":
                    continue
                value = decoder.decode(record.value)
                assert value is not None and record.key is not None
                below[record.key.decode()] = value
    return below, after


async def test_a_reader_of_topics_not_created_yet_reports_them_and_creates_none(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    """The brokers auto-create a topic a metadata request names, unless told not to: the
    readers start before the processors ever ran must leave the topics to their plan."""
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    names = settings.topics
    async with CompactedFollow(settings, [names.fleet, names.usage]) as follow:
        assert follow.missing == [names.fleet, names.usage]
        assert [batch async for batch in follow.snapshot()] == []
    async with TopicScan(settings, names.session_events) as scan:
        assert not scan.exists and scan.total == 0
    for topic in (names.fleet, names.usage, names.session_events):
        assert not await topic_exists(settings, topic)
