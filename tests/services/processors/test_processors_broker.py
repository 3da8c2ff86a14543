"""The processors worker against the real local broker: one shared worker for this module.

Tables must equal core's folds over generated sessions (replaces included), published changes
must rebuild the conversations, usage windows close on wall-clock time, duplicates are
ignored, gaps reported and garbage dead-lettered.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from processors_support import Worker, event_records, free_port, generated_sessions, read_topic
from shared_paths import SHARED_DIR

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.records import record_key
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.fleet import FleetStatus
from pipeline.core.log import derive_messages
from pipeline.core.projection import rebuild_conversations
from pipeline.core.usage import TokenCounts, UsageScan
from pipeline.services.processors.verify import counts_of_record, verify_processors, wait_ready
from pipeline.settings import Settings

pytestmark = pytest.mark.broker
FIXTURES = (SHARED_DIR / "fixtures")


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Settings, Worker]]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap, topic_prefix=prefix,
                                 partitions=3, replication_factor=1,
                                 group_id_prefix=f"{prefix}g-")
    asyncio.run(ensure_topics(settings))
    worker = Worker(settings, free_port(), tmp_path_factory.mktemp("processors"),
                    ["--windows", "2s=2,hour=3600", "--grace", "3", "--tick", "0.3"])
    try:
        worker.wait_ready()
        yield settings, worker
    finally:
        worker.stop()


def now_ms() -> int:
    return int(time.time() * 1000)


async def test_tables_equal_core_folds_over_generated_sessions(
        stack: tuple[Settings, Worker]) -> None:
    settings, worker = stack
    await wait_ready(worker.url(""), timeout_s=10)   # what the demo calls first
    sessions = generated_sessions(7, 24, "gen", ["model-a", "model-b"], now_ms())
    records = [r for sid, events in sessions.items()
               for r in event_records(settings, sid, events)]
    await send_records(settings, records)

    report = await verify_processors(worker.url(""), sessions, timeout_s=60, check_models=True)
    assert report.ok, (report.problems, worker.get("/health"), worker.tail())
    assert report.summary() == {"derived_mismatches": 0, "usage_mismatches": 0}

    # A consumer of the compacted topic rebuilds every conversation from the changes.
    published = await read_topic(settings, settings.topics.derived_messages)
    rebuilt = rebuild_conversations((key, value) for key, value, _h in published)
    for sid, events in sessions.items():
        assert rebuilt.get(sid, []) == list(derive_messages(events)), sid

    # Fleet status equals the pure fold (chunks are not folded there).
    for sid, events in list(sessions.items())[:5]:
        expected = FleetStatus(sid)
        for event in events:
            if event.type != "assistant/chunk":
                expected.apply(event)
        assert worker.get(f"/fleet/sessions/{sid}") == (200, expected.to_json())


async def test_recorded_fixtures_derive_exactly_what_dsh_derives(
        stack: tuple[Settings, Worker]) -> None:
    settings, worker = stack
    paths = sorted(FIXTURES.glob("**/*.jsonl"))
    logs = {f"fx-{p.stem}": list(read_session_file(p).events) for p in paths}
    await send_records(settings, [r for sid, events in logs.items()
                                  for r in event_records(settings, sid, events)])
    assert (await verify_processors(worker.url(""), logs, timeout_s=30)).ok
    for path in paths:
        expected = json.loads(path.with_name(path.stem + ".derived.json").read_text())
        assert worker.get(f"/sessions/fx-{path.stem}/messages")[1]["messages"] == expected


async def test_messages_as_of_an_earlier_seq(stack: tuple[Settings, Worker]) -> None:
    settings, worker = stack
    sessions = generated_sessions(11, 1, "at", ["m"], now_ms())
    (sid, events), = sessions.items()
    await send_records(settings, event_records(settings, sid, events))
    assert (await verify_processors(worker.url(""), sessions, timeout_s=30)).ok
    for at in (-1, 3, len(events) // 2, len(events) - 1):
        status, body = worker.get(f"/sessions/{sid}/messages?at_seq={at}")
        assert status == 200 and body["messages"] == list(derive_messages(events[:at + 1]))
    assert worker.get(f"/sessions/{sid}/messages?at_seq=x")[0] == 400
    assert worker.get("/sessions/no-such-session/messages")[0] == 404


async def test_duplicates_ignored_gaps_reported_garbage_dead_lettered(
        stack: tuple[Settings, Worker]) -> None:
    settings, worker = stack
    sessions = generated_sessions(3, 2, "dlv", ["m"], now_ms())
    (dup_id, dup_events), (gap_id, gap_events) = sessions.items()
    dups = event_records(settings, dup_id, dup_events)
    gaps = event_records(settings, gap_id, gap_events)
    garbage = OutRecord(settings.topics.session_events, record_key(dup_id), b"not avro at all",
                        (("dsh.type", b"user/message"), ("dsh.seq", b"999")))
    _s, before = worker.get("/health")
    # All of dup's events with a replayed stretch in the middle, then garbage; gap's events
    # with seq 5 missing.
    await send_records(settings, [*dups[:10], *dups[4:8], garbage, *dups[10:]])
    await send_records(settings, [*gaps[:5], *gaps[6:]])

    report = await verify_processors(worker.url(""), {dup_id: dup_events}, timeout_s=30)
    assert report.ok, report.problems
    worker.wait_for("the gap session folded up to its hole", lambda: (worker.get(
        f"/sessions/{gap_id}/messages")[1] or {}).get("nextSeq") == 5, timeout_s=30)
    _s, body = worker.get(f"/sessions/{gap_id}/messages")
    assert body["messages"] == list(derive_messages(gap_events[:5]))

    def grown() -> dict[str, int]:
        _s, after = worker.get("/health")
        return {k: after["counters"][k] - before["counters"][k] for k in before["counters"]}

    # Every record after the hole is a gap: reported, never folded past.
    worker.wait_for("gap records reported",
                    lambda: grown()["gaps"] >= len(gap_events) - 6, timeout_s=30)
    assert grown()["gaps"] == len(gap_events) - 6
    assert grown()["duplicates"] == 4

    dlq = settings.topics.dlq(settings.topics.session_events)
    worker.wait_for("dead letters readable", lambda: _in_thread(
        lambda: len(asyncio.run(read_topic(settings, dlq))) >= len(gap_events) - 5))
    letters = await read_topic(settings, dlq)
    by_class: dict[bytes, list[tuple[str, object, dict[str, bytes]]]] = {}
    for letter in letters:
        by_class.setdefault(letter[2]["dsh.error.class"], []).append(letter)
    (codec_letter,) = by_class[b"CodecError"]
    assert codec_letter[0] == dup_id and codec_letter[1] == b"not avro at all"
    assert codec_letter[2]["dsh.original.topic"] == settings.topics.session_events.encode()
    gap_letters = [x for x in by_class[b"SequenceError"] if x[0] == gap_id]
    assert len(gap_letters) == len(gap_events) - 6
    assert b"expected seq 5, found 6 (gap)" in gap_letters[0][2]["dsh.error.message"]


async def test_windows_close_on_wall_clock_and_late_samples_are_reported(
        stack: tuple[Settings, Worker]) -> None:
    settings, worker = stack
    provider = f"win{uuid.uuid4().hex[:6]}"
    # Stamped a little ahead, so a busy machine's processing lag cannot make them late.
    on_time = generated_sessions(5, 1, provider, ["m"], now_ms() + 3_000)
    late = generated_sessions(6, 1, provider + "-late", ["m"], now_ms() - 120_000)
    (late_id, late_events), = late.items()
    late = {late_id.replace("-late", "-old"): late_events}
    _s, before = worker.get("/health")
    for sid, events in [*on_time.items(), *late.items()]:
        # Late session events carry the same provider so they land in the same model key.
        events = [e if e.type != "assistant/message" else _with_provider(e, provider)
                  for e in events]
        if sid in late:
            late[sid] = events
        await send_records(settings, event_records(settings, sid, events))
    scan = UsageScan()
    for sid, events in [*on_time.items(), *late.items()]:
        scan.add_log(sid, events)

    def closed_windows_cover_on_time_usage() -> bool:
        records = asyncio.run(read_topic(settings, settings.topics.usage))
        closed = [v for k, v, _h in records if k.startswith("window/2s/") and
                  v["gen_ai.provider.name"] == provider and v["closed"]]
        total = sum((counts_of_record(v) for v in closed), TokenCounts())
        return total == scan.by_session[next(iter(on_time))]

    worker.wait_for("2s windows closed by ticks", lambda: _in_thread(
        closed_windows_cover_on_time_usage), timeout_s=30)
    _s, after = worker.get("/health")
    late_samples = sum(1 for e in late[next(iter(late))] if e.type == "assistant/message")
    assert after["counters"]["late_window_samples"] - before["counters"][
        "late_window_samples"] == late_samples
    # Model totals still include the late samples: totals equal a full scan.
    _s, models = worker.get("/usage/models")
    found = [counts_of_record(m) for m in models["models"]
             if m["gen_ai.provider.name"] == provider]
    assert found == [scan.by_model[f"{provider}/m"]]


def _with_provider(event: object, provider: str) -> object:
    from dataclasses import replace
    data = dict(event.data)  # type: ignore[attr-defined]
    message = dict(data["message"])
    message["source"] = {**message["source"], "provider": provider}
    data["message"] = message
    return replace(event, data=data)  # type: ignore[type-var]


def _in_thread(check: object) -> bool:
    """Run a check that uses asyncio.run from inside a running loop's test."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return bool(pool.submit(check).result())  # type: ignore[arg-type]


def test_worker_log_has_no_tracebacks(stack: tuple[Settings, Worker]) -> None:
    assert "Traceback" not in Path(stack[1].log_path).read_text(errors="replace")
