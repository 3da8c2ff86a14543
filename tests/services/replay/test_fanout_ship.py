"""The shipper on the real broker: files growing, a torn last line completing, a restart (the
earlier shipper fenced, not closed): every event on the topic exactly once, in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fanout_support import FIXTURES, SERDE, fanout_settings

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.topic_scan import TopicScan, last_seqs
from pipeline.adapters.kafka.transactional import FencedError
from pipeline.codec.sessionfile import read_session_file, write_session_file
from pipeline.services.replay.ship import Shipper
from pipeline.services.replay.transfer import read_session
from pipeline.settings import Settings


def _lines_with_id(source: Path, session_id: str) -> list[str]:
    lines = source.read_text().splitlines()
    header = json.loads(lines[0])
    header["id"] = session_id
    return [json.dumps(header, separators=(",", ":")), *lines[1:]]


@pytest.mark.broker
async def test_ship_growing_files_across_a_restart_publishes_each_event_once(
        kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> None:
    settings: Settings = fanout_settings(kafka_bootstrap, topic_prefix)
    await ensure_topics(settings)
    growing = tmp_path / "ship-a" / "session.jsonl"
    growing.parent.mkdir()
    a_lines = _lines_with_id(FIXTURES / "agent-instructions.jsonl", "ship-a")
    cut = len(a_lines) // 2
    torn = a_lines[cut][: len(a_lines[cut]) // 2]
    growing.write_text("\n".join(a_lines[:cut]) + "\n" + torn)
    b_source = read_session_file(FIXTURES / "tool-call-turn.jsonl")
    compressed = tmp_path / "ship-b" / "session.jsonl.zstd"
    compressed.parent.mkdir()
    write_session_file(compressed, b_source.events, header={**(b_source.header or {}),
                                                            "id": "ship-b"}, packed=True)
    progress: list[str] = []

    first = Shipper(settings, tmp_path, SERDE.encode, batch=4, progress=progress.append)
    await first.__aenter__()
    await first.run()
    a_prefix = read_session_file(growing).events
    assert await last_seqs(settings, settings.topics.session_events) == {
        "ship-a": a_prefix[-1].seq, "ship-b": len(b_source.events) - 1}
    assert "torn" not in " ".join(first.stats.problems)

    # The writer completes the torn line and appends the rest; the shipper "crashes" (never
    # closed) and a new one starts: it fences the first and resumes from the topic.
    growing.write_text("\n".join(a_lines) + "\n")
    async with Shipper(settings, tmp_path, SERDE.encode, batch=4) as second:
        await second.run()
        assert second.stats.published == len(read_session_file(growing).events) - len(a_prefix)
        assert await second.pass_once() == 0
    with pytest.raises(FencedError):  # the first shipper can never publish again
        await first.producer.commit([OutRecord(settings.topics.dlq(
            settings.topics.session_events), b"zombie", b"x")])
    await first.__aexit__(None, None, None)
    async with Shipper(settings, tmp_path, SERDE.encode) as third:
        assert await third.pass_once() == 0

    a_all = read_session_file(growing)
    for sid, source in (("ship-a", a_all), ("ship-b", b_source)):
        assert (await read_session(settings, sid, SERDE.decode)).events == list(source.events)
    async with TopicScan(settings, settings.topics.session_events) as scan:
        records = [r async for batch in scan.batches() for r in batch]
    assert len(records) == len(a_all.events) + len(b_source.events)  # no duplicates
    assert progress and progress[-1].startswith("shipped ")
