"""Offsets of the batched session topic: the worker folds whole fetched batches as one faust
event and skips chunks inside them, so faust sees offset gaps. Committed offsets must still
reach the end of the partition (also when its first record, at offset 0, was fetched alone),
and a worker restarted after a kill -9 must not fold anything again."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from processors_support import (
    Worker,
    committed_and_ends,
    event_records,
    free_port,
    generated_sessions,
    read_topic,
)

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.services.processors.verify import verify_processors
from pipeline.settings import Settings

pytestmark = pytest.mark.broker


async def _wait_committed(settings: Settings, offsets: dict[int, int], worker: Worker) -> None:
    """Until the group's committed offsets are ``offsets`` (= the end of the topic)."""
    deadline = time.monotonic() + 60
    while True:
        committed, ends = await committed_and_ends(settings)
        if committed == offsets == ends:
            return
        assert time.monotonic() < deadline, (committed, ends, worker.tail())
        await asyncio.sleep(0.5)


async def _fresh_topics(bootstrap: str, partitions: int,
                        max_record_bytes: int | None = None) -> Settings:
    """Settings of a new topic prefix (and group), its topics created."""
    prefix = f"t{uuid.uuid4().hex[:10]}."
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                                 partitions=partitions, replication_factor=1,
                                 group_id_prefix=f"{prefix}g-",
                                 max_record_bytes=max_record_bytes)
    await ensure_topics(settings)
    return settings


def _records(worker: Worker) -> int:
    return int(worker.get("/health")[1]["counters"]["records"])


async def test_committed_offsets_reach_the_end_and_a_restart_redelivers_nothing(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = await _fresh_topics(kafka_bootstrap, partitions=1)
    sessions = generated_sessions(31, 12, "off", ["m"], int(time.time() * 1000),
                                  max_chunks=40)
    worker = Worker(settings, free_port(), tmp_path)
    try:
        worker.wait_ready()
        # One record alone at offset 0, folded and committed, then batches of many offsets:
        # the case faust's own gap bookkeeping never commits past (it records no gap after
        # a message at offset 0).
        records = [r for sid, events in sessions.items()
                   for r in event_records(settings, sid, events)]
        await send_records(settings, records[:1])
        await _wait_committed(settings, {0: 1}, worker)
        await send_records(settings, records[1:])
        assert (await verify_processors(worker.url(""), sessions, timeout_s=60)).ok
        assert _records(worker) == len(records)
        await _wait_committed(settings, {0: len(records)}, worker)
    finally:
        worker.kill9()   # no graceful final commit: what was committed while running counts

    more = generated_sessions(32, 9, "off2", ["m"], int(time.time() * 1000), max_chunks=40)
    await _restart_folds_only(settings, tmp_path, sessions, more)


async def _restart_folds_only(settings: Settings, tmp_path: Path,
                              before: dict[str, Any], more: dict[str, Any]) -> None:
    """A restarted worker given ``more`` sessions shows all of them and ``before``, having
    folded only the new records: nothing before the committed offsets came again."""
    restarted = Worker(settings, free_port(), tmp_path)
    try:
        restarted.wait_ready()
        await send_records(settings, [r for sid, events in more.items()
                                      for r in event_records(settings, sid, events)])
        report = await verify_processors(restarted.url(""), {**before, **more},
                                         timeout_s=60)
        assert report.ok, (report.problems, restarted.get("/health")[1],
                           await committed_and_ends(settings), restarted.tail(40))
        assert _records(restarted) == sum(len(events) for events in more.values())
        assert restarted.get("/health")[1]["counters"]["duplicates"] == 0
    finally:
        restarted.stop()


async def test_a_graceful_stop_persists_and_commits_what_was_folded(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    """Tables are written right before each commit: SIGTERM right after the last batch was
    folded must still write them and commit, so a restart folds nothing again."""
    settings = await _fresh_topics(kafka_bootstrap, partitions=2)
    sessions = generated_sessions(35, 10, "stop", ["m"], int(time.time() * 1000),
                                  max_chunks=40)
    records = [r for sid, events in sessions.items() for r in event_records(settings, sid, events)]
    worker = Worker(settings, free_port(), tmp_path)
    try:
        worker.wait_ready()
        await send_records(settings, records)
        assert (await verify_processors(worker.url(""), sessions, timeout_s=60)).ok
    finally:
        worker.stop()   # at once: the last batches are folded, maybe not yet persisted
    assert worker.proc.returncode == 0, worker.tail()
    committed, ends = await committed_and_ends(settings)
    assert committed == ends, (committed, ends, worker.tail())

    more = generated_sessions(36, 4, "stop2", ["m"], int(time.time() * 1000))
    await _restart_folds_only(settings, tmp_path, sessions, more)


async def test_a_message_too_large_for_a_table_record_stops_its_session_alone(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    """A message whose ``nodes`` record would be above the producer's record limit (JSON
    doubles the quotes Avro keeps raw) is dead-lettered and stops its session, as an invalid
    event does: the worker goes on and commits past it. (Written, the record would have
    been refused at the next commit and stopped every later table write of the worker.)"""
    # the smallest record limit (1 MiB), which the 600 KB event fits and its JSON does not
    settings = await _fresh_topics(kafka_bootstrap, partitions=1, max_record_bytes=1024 * 1024)
    from pipeline.core.events import Event
    message = {"id": "u0", "role": "user", "content": [{"type": "text", "text": '"' * 600_000}],
               "source": {"kind": "user"}}
    worker = Worker(settings, free_port(), tmp_path)
    try:
        worker.wait_ready()
        good = generated_sessions(33, 2, "ok", ["m"], int(time.time() * 1000))
        before = [r for sid, events in good.items() for r in event_records(settings, sid, events)]
        await send_records(settings, before)
        assert (await verify_processors(worker.url(""), good, timeout_s=60)).ok
        big = event_records(settings, "big", [Event("user/message", 0, 0, message, "append")])
        more = generated_sessions(34, 2, "after", ["m"], int(time.time() * 1000))
        after = [r for sid, events in more.items() for r in event_records(settings, sid, events)]
        await send_records(settings, [*big, *after])
        assert (await verify_processors(worker.url(""), more, timeout_s=60)).ok
        counters = worker.get("/health")[1]["counters"]
        assert (counters["invalid_events"], counters["failed_batches"]) == (1, 0)
        letters = [h for _, _, h in await read_topic(settings, settings.topics.dlq(
            settings.topics.session_events))]
        assert [h["dsh.error.class"] for h in letters] == [b"EventError"]
        assert b"message-record-size" in letters[0]["dsh.error.message"]
        await _wait_committed(settings, {0: len(before) + 1 + len(after)}, worker)
    finally:
        worker.stop()
