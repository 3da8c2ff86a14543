"""A dashboard started against a session topic that already holds history (folded by a real
processors worker) shows the fleet and a session page from the processors' outputs, and
reads no session-topic record older than the live tail: its tail starts at the end offsets
of start-up, and a session page reads its partition only from after the event of the
session's last derived change. ``dsh-pipeline sessions`` lists the same fleet."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_support import (
    LiveSession,
    SseMessages,
    aget,
    dashboard_settings,
    eventually,
    publish,
    read_sse,
)
from processors_support import ROOT, Worker, free_port, generated_sessions, worker_env

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.compacted import CompactedFollow
from pipeline.adapters.kafka.session_first import first_offset_of
from pipeline.adapters.kafka.topic_scan import TopicScan
from pipeline.codec.avro import EventSerde
from pipeline.codec.outputs import OutputDecoder
from pipeline.codec.records import read_headers
from pipeline.core.events import SURFACE_TYPES
from pipeline.core.fleet import FleetStatus
from pipeline.core.log import derive_messages
from pipeline.core.usage import UsageScan
from pipeline.sdk import Snapshot, follow_fleet
from pipeline.services.dashboard.server import start_dashboard
from pipeline.services.replay.transfer import read_session
from pipeline.settings import Settings


@pytest.fixture
def history_settings(kafka_bootstrap: str, topic_prefix: str) -> Settings:
    return dashboard_settings(kafka_bootstrap, topic_prefix)


@pytest.fixture
def worker(history_settings: Settings, tmp_path: Path) -> Iterator[Worker]:
    started = Worker(history_settings, free_port(), tmp_path / "processors")
    try:
        yield started
    finally:
        started.stop()


async def _published_fleet(settings: Settings, expected: dict[str, int]) -> bool:
    """The processors have published every session's status up to its last seq."""
    follow = follow_fleet(settings, decoder=OutputDecoder())
    async with contextlib.aclosing(follow):
        item = await anext(follow)
    assert isinstance(item, Snapshot)
    values = item.view.values
    return all(values.get(sid, {}).get("last_seq", -1) >= seq for sid, seq in expected.items())


async def _ends_and_last_surface(settings: Settings, session_id: str
                                 ) -> tuple[dict[int, int], tuple[int, int]]:
    """The session topic's end offsets, and (partition, offset) of ``session_id``'s last
    surface event (found by the test itself, from the record headers)."""
    topic = settings.topics.session_events
    async with CompactedFollow(settings, [topic], live_only=True) as tail:
        ends = {tp.partition: end for tp, end in tail.ends.items()}
    last = (-1, -1)
    async with TopicScan(settings, topic) as scan:
        async for batch in scan.batches():
            for record in batch:
                kind = read_headers(record.headers).type
                if record.key == session_id.encode() and kind in SURFACE_TYPES:
                    last = (record.partition, record.offset)
    return ends, last


async def test_history_is_read_from_the_outputs_and_the_tail_only(
        history_settings: Settings, worker: Worker) -> None:
    settings = history_settings
    await ensure_topics(settings)
    now = int(time.time() * 1000)
    history = generated_sessions(11, 12, "deepseek", ["chat-1", "reasoner-1"], now - 60_000)
    for session_id, events in history.items():
        await publish(settings, session_id, events)
    worker.wait_ready()
    last_seqs = {sid: max(e.seq for e in events if e.type != "assistant/chunk")
                 for sid, events in history.items()}
    await eventually(lambda: _published_fleet(settings, last_seqs), 120,
                     "the processors to publish the history's fleet")
    chosen = sorted(history)[3]
    ends, (partition, last_surface) = await _ends_and_last_surface(settings, chosen)

    await asyncio.to_thread(_sessions_command_lists, settings, history, worker)
    await _whole_session_reads_start_at_its_first_event(settings, history, worker)
    dashboard = await start_dashboard(settings, EventSerde().decode, host="127.0.0.1", port=0)
    try:
        base = dashboard.url

        async def ready() -> Any:
            _, _, body = await aget(base + "health")
            health = json.loads(body) if body else {}
            return health if health.get("ready") and health.get("tailStart") else None
        health = await eventually(ready, 60, "the dashboard ready")
        assert health["tailStart"] == {str(p): o for p, o in sorted(ends.items())}

        _, _, body = await aget(base + "api/fleet")
        rows = {r["session_id"]: r for r in json.loads(body)["sessions"]}
        usage = UsageScan()
        for session_id, events in history.items():
            usage.add_log(session_id, events)
            status = FleetStatus(session_id)
            for event in events:
                if event.type != "assistant/chunk":
                    status.apply(event)
            row = rows[session_id]
            assert (row["state"], row["turns"], row["steps"], row["last_seq"]) == (
                status.state, status.turns, status.steps, status.last_seq)
            totals = usage.by_session[session_id]
            assert row["output_tokens"] == totals.output_tokens
            assert row["input_tokens"] == (totals.input_tokens + totals.cache_read_tokens
                                           + totals.cache_write_tokens)

        # The session page: its derived messages, then its live events from the next seq.
        frames = await read_sse(base + f"api/stream/sessions/{chosen}", {},
                                until=lambda m: any(n == "caught-up" for n, _ in m))
        (name, snapshot), (caught_name, caught) = frames[0], frames[-1]
        assert name == "snapshot" and caught_name == "caught-up"
        assert snapshot["basis"] == "derived"
        assert snapshot["messages"] == list(derive_messages(history[chosen]))
        assert snapshot["fromOffset"] == last_surface + 1
        assert snapshot["partition"] == partition
        # Only the session's partition of the derived messages was read (session layout).
        assert snapshot["layout"] == "session"
        derived = await _records_per_partition(settings, settings.topics.derived_messages)
        assert snapshot["recordsRead"] == derived[partition] < sum(derived.values())
        last_change = max(e.seq for e in history[chosen] if e.type in SURFACE_TYPES)
        assert snapshot["atSeq"] == last_change
        tail_of_session = [e.seq for e in history[chosen] if e.seq > last_change]
        assert caught["nextSeq"] == (tail_of_session[-1] + 1 if tail_of_session
                                     else last_change + 1)

        # Live: a new turn of the session streams in, seqs continuing the history's.
        live = LiveSession(chosen)
        live.events = list(history[chosen])
        live.sent = len(live.events)
        live.turn = max(int(e.data["turn"]) for e in history[chosen] if e.type == "turn/start")
        live.start_turn("and now?")
        live.finish(live.answer(["live ", "text"]), "live text", {"inputTokens": 5,
                                                                 "outputTokens": 2})
        live.end_turn()
        new = live.take()
        frames_live = await _after_publish(base, chosen, settings, new,
                                           len(tail_of_session) + len(new))
        seqs = [f["seq"] for n, f in frames_live if n == "event"]
        assert seqs == tail_of_session + [e.seq for e in new]  # after the snapshot, once

        async def counted() -> Any:
            _, _, text = await aget(base + "health")
            found = json.loads(text)
            return found if found["events"] >= len(new) else None
        health = await eventually(counted, 30, "the live events counted")
        # Nothing older than the tail was read: the tail read only the new events, and
        # the session pages read the chosen partition only from after its last change.
        assert health["events"] == len(new)
        first = {int(p): o for p, o in health["sessionTopicReads"]["first"].items()}
        for p, offset in first.items():
            bound = last_surface + 1 if p == partition else ends.get(p, 0)
            assert offset >= bound, (p, offset, bound)
        assert first[partition] == last_surface + 1
        assert health["sessionTopicReads"]["records"] < sum(ends.values())
    finally:
        await dashboard.stop()


async def _records_per_partition(settings: Settings, topic: str) -> dict[int, int]:
    counts = dict.fromkeys(range(settings.partitions), 0)
    async with TopicScan(settings, topic) as scan:
        async for run in scan.client_batches():
            for record in run:
                counts[record.partition] += 1
    return counts


async def _after_publish(base: str, session_id: str, settings: Settings,
                         events: list[Any], wanted: int) -> SseMessages:
    """The first ``wanted`` ``event`` frames of a session stream opened before ``events``
    are published."""
    def all_events(messages: SseMessages) -> bool:
        return sum(1 for name, _ in messages if name == "event") >= wanted
    reading = asyncio.create_task(read_sse(base + f"api/stream/sessions/{session_id}", {},
                                           until=all_events))
    await asyncio.sleep(1.0)  # the stream is following before the events are published
    await publish(settings, session_id, events)
    frames = await reading
    return [f for f in frames if f[0] == "event"]


async def _first_offsets(settings: Settings) -> dict[str, tuple[int, int]]:
    """session -> (partition, offset) of its seq-0 record, from a scan of the topic."""
    found: dict[str, tuple[int, int]] = {}
    async with TopicScan(settings, settings.topics.session_events) as scan:
        async for run in scan.client_batches():
            for record in run:
                if read_headers(record.headers).seq == 0:
                    found[(record.key or b"").decode()] = (record.partition, record.offset)
    return found


async def _whole_session_reads_start_at_its_first_event(
        settings: Settings, history: dict[str, list[Any]], worker: Worker) -> None:
    """The processors' fleet record names where a session's first event lies; ``export``
    and ``tail SESSION --from-beginning`` read from there, in the session's partition."""
    firsts = await _first_offsets(settings)
    session_id = max(firsts, key=lambda sid: firsts[sid][1])   # the latest to begin
    partition, first = firsts[session_id]
    assert first > 0 and await first_offset_of(settings, session_id) == first
    assert await first_offset_of(settings, "never-seen") is None
    read: list[tuple[int, int]] = []
    session = await read_session(settings, session_id, EventSerde().decode, read=_add(read))
    assert session.events == history[session_id]
    assert min(read) == (partition, first) and {p for p, _ in read} == {partition}
    done = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "pipeline.cli.main", "tail", session_id, "--from-beginning",
        "-e", "--format", "json"], cwd=ROOT, env=worker_env(settings, worker.log_path.parent),
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shown = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["event"]["seq"] for r in shown] == [e.seq for e in history[session_id]]
    assert min(r["offset"] for r in shown) == first


def _add(into: list[tuple[int, int]]) -> Callable[[int, int], None]:
    return lambda partition, offset: into.append((partition, offset))


def _sessions_command_lists(settings: Settings, history: dict[str, list[Any]],
                            worker: Worker) -> None:
    """``dsh-pipeline sessions`` lists every session from ``fleet`` (JSON and table), and
    ``--state`` filters."""
    env = worker_env(settings, worker.log_path.parent)
    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "sessions", *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout
    rows = json.loads(run("--json"))
    usage = UsageScan()
    for session_id, events in history.items():
        usage.add_log(session_id, events)
    assert sorted(r["session_id"] for r in rows) == sorted(history)
    for row in rows:
        events = history[row["session_id"]]
        assert row["state"] == "idle"
        assert row["turns"] == sum(1 for e in events if e.type == "turn/start")
        assert row["last_activity_ms"] == max(e.time for e in events
                                              if e.type != "assistant/chunk")
        assert row["output_tokens"] == usage.by_session[row["session_id"]].output_tokens
    stamps = [r["last_activity_ms"] for r in rows]
    assert stamps == sorted(stamps, reverse=True)  # most recently active first
    assert json.loads(run("--json", "--state", "in-turn")) == []
    table = run("--state", "idle", "--limit", "3").splitlines()
    assert table[0].split()[:2] == ["session", "state"]
    assert [line.split()[0] for line in table[1:4]] == [r["session_id"] for r in rows[:3]]
    assert table[-1] == "3 sessions"


async def test_a_session_page_starts_from_the_processors_tables(
        history_settings: Settings, worker: Worker) -> None:
    """With ``DSH_DASHBOARD_PROCESSORS_URL`` the page reads no derived record: the owning
    worker answers the live surface and its committed offset, the page reads the session
    topic from there, and a live turn continues it with every event once. A dashboard whose
    processors do not answer says why and reads the derived-messages topic instead."""
    settings = history_settings
    await ensure_topics(settings)
    history = generated_sessions(6, 10, "deepseek", ["chat-1"], int(time.time() * 1000) - 60_000)
    for session_id, events in history.items():
        await publish(settings, session_id, events)
    worker.wait_ready()
    chosen = sorted(history)[2]
    last_seq = history[chosen][-1].seq

    def page_vouched() -> bool:
        status, body = worker.get(f"/sessions/{chosen}/page")
        return status == 200 and body["nextSeq"] == last_seq + 1
    worker.wait_for("the owning worker to vouch for the session's page", page_vouched, 120)
    ends, _ = await _ends_and_last_surface(settings, chosen)

    with_processors = dataclasses.replace(settings,
                                          dashboard_processors_url=worker.url(""))
    dashboard = await start_dashboard(with_processors, EventSerde().decode,
                                      host="127.0.0.1", port=0)
    try:
        frames = await read_sse(dashboard.url + f"api/stream/sessions/{chosen}", {},
                                until=lambda m: any(n == "caught-up" for n, _ in m))
        (name, snapshot), (_, caught) = frames[0], frames[-1]
        assert name == "snapshot" and snapshot["basis"] == "processors", snapshot
        assert snapshot["recordsRead"] == 0 and snapshot["processorsRefused"] is None
        assert snapshot["messages"] == list(derive_messages(history[chosen]))
        assert snapshot["atSeq"] == last_seq and caught["nextSeq"] == last_seq + 1
        partition = snapshot["partition"]
        assert 0 < snapshot["fromOffset"] <= ends[partition]  # the committed offset
        assert [n for n, _ in frames] == ["snapshot", "caught-up"]  # nothing re-sent

        live = LiveSession(chosen)
        live.events = list(history[chosen])
        live.sent = len(live.events)
        live.turn = max(int(e.data["turn"]) for e in history[chosen] if e.type == "turn/start")
        live.start_turn("and now?")
        live.finish(live.answer(["live"]), "live", {"inputTokens": 3, "outputTokens": 1})
        live.end_turn()
        new = live.take()
        frames_live = await _after_publish(dashboard.url, chosen, settings, new, len(new))
        assert [f["seq"] for n, f in frames_live if n == "event"] == [e.seq for e in new]
        _, _, body = await aget(dashboard.url + "health")
        reads = json.loads(body)["sessionTopicReads"]["first"]
        assert int(reads[str(partition)]) >= snapshot["fromOffset"]
    finally:
        await dashboard.stop()

    unanswered = dataclasses.replace(settings,
                                     dashboard_processors_url=f"http://127.0.0.1:{free_port()}")
    dashboard = await start_dashboard(unanswered, EventSerde().decode, host="127.0.0.1", port=0)
    try:
        frames = await read_sse(dashboard.url + f"api/stream/sessions/{chosen}", {},
                                until=lambda m: any(n == "caught-up" for n, _ in m))
        snapshot = frames[0][1]
        assert snapshot["basis"] == "derived" and snapshot["recordsRead"] > 0
        assert "did not answer" in snapshot["processorsRefused"]
        derived = list(derive_messages(history[chosen]))
        assert snapshot["messages"][:len(derived)] == derived
    finally:
        await dashboard.stop()
