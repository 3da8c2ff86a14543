"""Recovery: a worker killed with kill -9 mid-stream restarts (tables from their changelogs)
to exactly the state a full replay gives; a second worker shares the partitions and takes
over all of them when the first stops."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from processors_support import (
    Worker,
    event_records,
    free_port,
    fresh_settings,
    generated_sessions,
    read_topic,
)

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.core.events import Event
from pipeline.core.log import derive_messages
from pipeline.core.projection import rebuild_conversations
from pipeline.core.usage import TokenCounts, UsageScan
from pipeline.services.processors.verify import counts_of_record, verify_processors

pytestmark = pytest.mark.broker


async def _assert_equals_replay(worker: Worker, sessions: dict[str, list[Event]],
                                check_models: bool = True) -> None:
    began = time.monotonic()
    report = await verify_processors(worker.url(""), sessions, timeout_s=150,
                                     check_models=check_models)
    assert report.ok, (report.problems, worker.tail())
    print(f"verified {len(sessions)} sessions in {time.monotonic() - began:.1f}s")


def _models(worker: Worker) -> dict[str, TokenCounts]:
    """Model totals this worker owns (each model key lives on one worker)."""
    _status, body = worker.get("/usage/models")
    return {f"{m['gen_ai.provider.name']}/{m['gen_ai.request.model']}": counts_of_record(m)
            for m in body["models"]}


def _scan_models(sessions: dict[str, list[Event]]) -> dict[str, TokenCounts]:
    scan = UsageScan()
    for sid, events in sessions.items():
        scan.add_log(sid, events)
    return scan.by_model


def _handled(worker: Worker) -> int:
    return int(worker.get("/health")[1]["counters"]["records"])


def _partitions(worker: Worker) -> list[int]:
    status, body = worker.get("/health")
    if status != 200 or body["recovery"]["in_recovery"]:
        return []
    return list(body["partitions"])


async def test_kill9_mid_stream_then_restart_equals_full_replay_and_takeover(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = fresh_settings(kafka_bootstrap)
    await ensure_topics(settings)
    sessions = generated_sessions(21, 30, "rec", ["m1", "m2", "m3"], int(time.time() * 1000),
                                  max_chunks=30)
    first = {sid: events[:len(events) // 2] for sid, events in sessions.items()}
    batch1 = [r for sid, events in first.items() for r in event_records(settings, sid, events)]
    rest = [r for sid, events in sessions.items()
            for r in event_records(settings, sid, events[len(events) // 2 - 3:])]  # 3 dups each
    t0 = time.monotonic()
    worker = Worker(settings, free_port(), tmp_path)
    sent = 0
    try:
        worker.wait_ready()
        print(f"first worker ready at {time.monotonic() - t0:.1f}s")
        # A worker folds a backlog in a few batches: kill -9 it while records are still
        # arriving (some, not all, handled), so the kill falls between batches in flight.
        while sent < len(batch1) and (handled := _handled(worker)) <= len(batch1) // 10:
            await send_records(settings, batch1[sent:sent + 40])
            sent += 40
            if handled == 0:   # not folding yet (a loaded machine): do not outrun it
                await asyncio.sleep(0.2)
        handled_at_kill = _handled(worker)
    finally:
        worker.kill9()
    print(f"killed after {handled_at_kill} of {len(batch1)} records ({sent} sent)")
    assert 0 < handled_at_kill < len(batch1)
    await send_records(settings, batch1[sent:])
    await send_records(settings, rest)

    restarted = Worker(settings, free_port(), tmp_path)
    second: Worker | None = None
    try:
        restarted.wait_ready()
        print(f"restarted ready at {time.monotonic() - t0:.1f}s")
        await _assert_equals_replay(restarted, sessions)
        # The compacted topic, written across the crash, still rebuilds every conversation.
        published = await read_topic(settings, settings.topics.derived_messages)
        rebuilt = rebuild_conversations((key, value) for key, value, _h in published)
        assert all(rebuilt.get(sid, []) == list(derive_messages(events))
                   for sid, events in sessions.items())

        # A second worker joins: the partitions are shared, HTTP is routed to the owner.
        second = Worker(settings, free_port(), tmp_path)
        second.wait_for("partitions shared", lambda: bool(_partitions(second)) and len(
            _partitions(restarted)) < 3, timeout_s=90)
        print(f"shared at {time.monotonic() - t0:.1f}s")
        await _assert_equals_replay(restarted, sessions, check_models=False)
        await _assert_equals_replay(second, sessions, check_models=False)
        assert _models(restarted) | _models(second) == _scan_models(sessions)

        # The first stops: the second takes over every partition, with the same state.
        restarted.stop()
        second.wait_for("takeover", lambda: _partitions(second) == [0, 1, 2], timeout_s=90)
        print(f"taken over at {time.monotonic() - t0:.1f}s")
        more = generated_sessions(22, 6, "rec2", ["m1"], int(time.time() * 1000))
        await send_records(settings, [r for sid, events in more.items()
                                      for r in event_records(settings, sid, events)])
        await _assert_equals_replay(second, {**sessions, **more})
    finally:
        restarted.stop()
        if second is not None:
            second.stop()
