"""``dsh-pipeline replay`` on the real broker: the projection rebuilt from offset 0 equals
core's derivation (the fixtures' expected messages), readers switch to it; a deliberately
corrupted live version is reported and not switched away from silently; one session printed
as JSONL or a transcript."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest
from fanout_support import FIXTURES, SERDE, fanout_settings, publish

from dsh_dev.synth import synth_session
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.cli.main import main
from pipeline.codec.output_views import DerivedView
from pipeline.codec.outputs import OutputDecoder, default_output_codecs
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.events import SURFACE_TYPES
from pipeline.core.projection import slot_key
from pipeline.sdk import (
    Snapshot,
    active_version,
    derived_conversations,
    follow_derived,
    partition_for,
)
from pipeline.services.replay.rebuild import Rebuilder, read_conversations
from pipeline.settings import Settings

NAMES = ("text-turn", "tool-call-turn", "agent-instructions")


def _env(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    monkeypatch.setenv("DSH_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    monkeypatch.setenv("DSH_TOPIC_PREFIX", settings.topic_prefix)
    monkeypatch.setenv("DSH_PARTITIONS", str(settings.partitions))


async def _publish_fixtures(settings: Settings) -> None:
    await ensure_topics(settings)
    for name in NAMES:
        await publish(settings, name, read_session_file(FIXTURES / f"{name}.jsonl").events)


@pytest.mark.broker
def test_replay_builds_verifies_switches_and_reports_a_corrupted_version(
        kafka_bootstrap: str, topic_prefix: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    asyncio.run(_publish_fixtures(settings))
    _env(monkeypatch, settings)
    expected = {name: json.loads((FIXTURES / f"{name}.derived.json").read_text())
                for name in NAMES}

    assert main(["replay"]) == 0
    out = capsys.readouterr()
    first = json.loads(out.out.splitlines()[-1])
    assert (first["version"], first["differences"], first["switched"]) == (1, 0, True)
    assert first["events"] == sum(len(read_session_file(FIXTURES / f"{n}.jsonl").events)
                                  for n in NAMES)
    assert "events/s" in out.err and "ETA" in out.err
    assert "core's derivation" in first["compared_with"]
    assert asyncio.run(active_version(settings)).version == 1
    assert asyncio.run(derived_conversations(settings)) == expected
    positions = asyncio.run(_derived_positions(settings))
    before: dict[int, int] = {}  # records published to each partition so far (in order)
    for name in NAMES:  # the rebuild writes each change's source position, as the processors
        events = read_session_file(FIXTURES / f"{name}.jsonl").events
        last_surface = max(e.seq for e in events if e.type in SURFACE_TYPES)
        partition = partition_for(name, settings.partitions)
        assert positions[name] == (partition, before.get(partition, 0) + last_surface)
        before[partition] = before.get(partition, 0) + len(events)

    # Corrupt version 1 (the live one now): one message of one session changed.
    live = asyncio.run(active_version(settings)).topic
    forged = {"session": "text-turn", "slot": 1, "seq": 1, "changeSeq": 1, "op": "append",
              "message": {"role": "user", "content": [{"type": "text", "text": "forged"}]}}
    first_slot = _first_slot(settings, live, "text-turn")
    asyncio.run(send_records(settings, [OutRecord(   # where the version's layout puts it
        live, slot_key("text-turn", first_slot).encode(),
        default_output_codecs().derived.encode(forged) or b"", (),
        partition_for("text-turn", settings.partitions))]))

    assert main(["replay"]) == 1  # differs from the live version: reported, not switched
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert [line for line in lines if line.startswith("difference:")] == [
        f"difference: text-turn: message 0 differs: v1 {_compact(forged['message'])} != new "
        f"{_compact(expected['text-turn'][0])}"[:len(lines[0])]]
    second = json.loads(lines[-1])
    assert (second["version"], second["differences"], second["switched"]) == (2, 1, False)
    assert asyncio.run(active_version(settings)).version == 1

    assert main(["replay", "--force"]) == 0  # compared with v1 again, switched anyway
    third = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (third["version"], third["switched"]) == (3, True)
    assert asyncio.run(derived_conversations(settings)) == expected


def _first_slot(settings: Settings, topic: str, session_id: str) -> int:
    from pipeline.adapters.kafka.topic_scan import TopicScan

    async def scan() -> int:
        slots: list[int] = []
        async with TopicScan(settings, topic) as found:
            async for batch in found.batches():
                slots += [int(r.key.decode().rpartition("/")[2]) for r in batch
                          if r.key and r.key.decode().startswith(session_id + "/")
                          and r.value is not None]
        return min(slots)
    return asyncio.run(scan())


def _compact(message: object) -> str:
    text = json.dumps(message, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= 160 else text[:157] + "..."


@pytest.mark.broker
def test_replay_session_prints_jsonl_and_a_transcript(
        kafka_bootstrap: str, topic_prefix: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    asyncio.run(_publish_fixtures(settings))
    _env(monkeypatch, settings)
    assert main(["replay", "--session", "tool-call-turn", "--jsonl"]) == 0
    printed = capsys.readouterr().out.splitlines()
    source = (FIXTURES / "tool-call-turn.jsonl").read_text().splitlines()
    # the same JSON as dsh wrote (published without the importer's header and key order)
    assert [json.loads(line) for line in printed[1:]] == [json.loads(line)
                                                           for line in source[1:]]
    assert json.loads(printed[0]) == {"type": "session", "version": 0, "id": "tool-call-turn"}
    assert main(["replay", "--session", "tool-call-turn"]) == 0
    text = capsys.readouterr().out
    assert "▶ turn 1" in text and "→ bash(" in text and "assistant: DONE" in text
    assert "■ turn 1 completed" in text


@pytest.mark.broker
def test_replay_equals_the_processors_live_projection(
        kafka_bootstrap: str, topic_prefix: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from processors_support import Worker, free_port

    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    asyncio.run(_publish_fixtures(settings))
    _env(monkeypatch, settings)
    worker = Worker(settings, free_port(), tmp_path / "processors")
    try:
        worker.wait_ready()
        for name in NAMES:
            count = len(read_session_file(FIXTURES / f"{name}.jsonl").events)
            worker.wait_for(f"{name} folded", lambda n=name, c=count: worker.get(
                f"/sessions/{n}/messages")[1].get("nextSeq") == c)
        assert main(["check", "--processors", worker.url("")]) == 0
        assert json.loads(capsys.readouterr().out)["derived_mismatches"] == 0
    finally:
        worker.stop()  # flushes what the worker still had to publish

    assert main(["replay"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["compared_with"].startswith("version 0 (")  # the processors' topic
    assert (summary["differences"], summary["switched"], summary["version"]) == (0, True, 1)


@pytest.mark.broker
def test_rebuild_coalesces_by_slot_key_and_tombstones_only_written_slots(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    asyncio.run(_publish_fixtures(settings))
    # 2000 synthetic events: a compaction replaces 26 nodes (25 slots removed).
    asyncio.run(publish(settings, "synth", synth_session(0, 2000)))
    # Flushed after every record, the removed slots were written first, so they get
    # tombstones; coalesced over the whole run, they are never written at all.
    eager = asyncio.run(Rebuilder(settings, SERDE.decode, 1, coalesce_keys=1, scan_batch=1,
                                  with_core=True).run())
    coalesced = asyncio.run(Rebuilder(settings, SERDE.decode, 2).run())
    assert eager.core is not None and set(eager.core) == {*NAMES, "synth"}
    assert coalesced.changes == eager.changes
    assert coalesced.records_written < eager.records_written <= eager.changes
    assert _tombstones(settings, eager.topic) == 25
    assert _tombstones(settings, coalesced.topic) == 0
    for result in (eager, coalesced):
        assert result.conversations == eager.core
        assert asyncio.run(read_conversations(settings, result.topic)) == eager.core


def _tombstones(settings: Settings, topic: str) -> int:
    from pipeline.adapters.kafka.topic_scan import TopicScan

    async def scan() -> int:
        async with TopicScan(settings, topic) as found:
            return sum([sum(r.value is None for r in batch)
                        async for batch in found.batches()])
    return asyncio.run(scan())


async def _derived_positions(settings: Settings) -> dict[str, tuple[int, int]]:
    """Session -> (partition, offset) of its latest derived change's source, as the active
    version holds them."""
    follow = follow_derived(settings, decoder=OutputDecoder())
    async with contextlib.aclosing(follow):
        snapshot = await anext(follow)
    assert isinstance(snapshot, Snapshot) and isinstance(snapshot.view, DerivedView)
    return {sid: (p.partition, p.offset) for sid, p in snapshot.view.positions.items()}
