"""Import and export on the real broker: export(import(x)) == x byte for byte, re-import
publishes nothing, a conflicting file is refused before anything is sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fanout_support import FIXTURES, SERDE, fanout_settings

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.topic_scan import last_seqs
from pipeline.core.errors import EventError
from pipeline.services.replay.transfer import Importer, export_session
from pipeline.settings import Settings


@pytest.fixture
def fan_settings(kafka_bootstrap: str, topic_prefix: str) -> Settings:
    return fanout_settings(kafka_bootstrap, topic_prefix)


@pytest.mark.broker
async def test_export_of_an_import_is_the_file_byte_for_byte(fan_settings: Settings,
                                                              tmp_path: Path) -> None:
    settings = fan_settings
    await ensure_topics(settings)
    sources = sorted(FIXTURES.glob("*.jsonl"))
    async with Importer(settings, SERDE.encode, SERDE.decode) as importer:
        first = [await importer.import_file(p, session_id=p.stem) for p in sources]
        again = [await importer.import_file(p, session_id=p.stem) for p in sources]
    assert [r.published for r in first] == [r.events for r in first]
    assert all(r.published == 0 and r.already_on_topic == r.events for r in again)
    assert await last_seqs(settings, settings.topics.session_events) == {
        r.session_id: r.events - 1 for r in first}
    for path in sources:
        out = tmp_path / path.name
        await export_session(settings, path.stem, out, SERDE.decode)
        assert out.read_bytes() == path.read_bytes(), path.name


@pytest.mark.broker
async def test_a_conflicting_file_is_refused_and_nothing_is_published(
        fan_settings: Settings, tmp_path: Path) -> None:
    settings = fan_settings
    await ensure_topics(settings)
    source = FIXTURES / "text-turn.jsonl"
    lines = source.read_text().splitlines()
    changed = json.loads(lines[2])  # seq 1, which the half file below already published
    changed["time"] += 1
    conflicting = tmp_path / "text-turn.jsonl"
    conflicting.write_text("\n".join([*lines[:2], json.dumps(changed), *lines[3:]]) + "\n")
    half = tmp_path / "half.jsonl"
    half.write_text("\n".join(lines[:3]) + "\n")
    async with Importer(settings, SERDE.encode, SERDE.decode) as importer:
        assert (await importer.import_file(half, session_id="s")).published == 2
        with pytest.raises(EventError, match=r"seq 1.*conflicts with the topic"):
            await importer.import_file(conflicting, session_id="s")
    # the refused file left the topic as it was; the original file still imports
    assert await last_seqs(settings, settings.topics.session_events) == {"s": 1}
    async with Importer(settings, SERDE.encode, SERDE.decode) as importer:
        result = await importer.import_file(source, session_id="s")
    assert (result.already_on_topic, result.published) == (2, result.events - 2)
