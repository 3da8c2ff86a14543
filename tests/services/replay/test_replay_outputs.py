"""Replay and the derived-messages topic as Avro (real broker): a rebuilt version holds
``dsh.DerivedMessageChange`` records, and reading a version back skips what does not
decode, counted and listed, instead of crashing."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import replace

import pytest
from fanout_support import FIXTURES, SERDE, fanout_settings, publish
from processors_support import event_records

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.topic_scan import TopicScan, ensure_topic
from pipeline.adapters.registry.client import RegistryClient, event_serde_for_topic
from pipeline.adapters.registry.outputs import output_codecs_for_topics
from pipeline.cli.main import main
from pipeline.codec.outputs import OutputDecoder, default_output_codecs
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.fleet import FleetStatus
from pipeline.core.projection import MessageChange
from pipeline.sdk import derived_conversations
from pipeline.services.replay.compare import VersionContent, read_version
from pipeline.services.replay.rebuild import Rebuilder
from pipeline.settings import Settings

pytestmark = pytest.mark.broker


async def _values(settings: Settings, topic: str) -> list[bytes | None]:
    async with TopicScan(settings, topic) as scan:
        return [r.value async for batch in scan.batches() for r in batch]


def _message(text: str) -> dict[str, object]:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def test_a_rebuilt_version_is_avro_and_reads_back(kafka_bootstrap: str,
                                                  topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    events = list(read_session_file(FIXTURES / "tool-call-turn.jsonl").events)
    asyncio.run(publish(settings, "tool-call-turn", events))
    result = asyncio.run(Rebuilder(settings, SERDE.decode, 1, with_core=True).run())
    values = asyncio.run(_values(settings, result.topic))
    assert values and all(v is not None and v[:2] == b"\xc3\x01" for v in values)
    decoder = OutputDecoder()
    assert all(decoder.schema_of(v or b"").name == "dsh.DerivedMessageChange" for v in values)
    content = asyncio.run(read_version(settings, result.topic))
    assert content is not None and content.undecodable == 0
    assert content.conversations == result.core == result.conversations


def test_undecodable_records_of_a_version_are_skipped_counted_and_listed(
        settings: Settings) -> None:
    topic = settings.topics.derived_messages
    avro = default_output_codecs().derived.encode_change(
        MessageChange("s-1", 0, 0, 0, "append", _message("avro"))) or b""
    legacy = MessageChange("s-1", 1, 1, 1, "append", _message("legacy json")).to_json()
    fleet = default_output_codecs().fleet.encode(FleetStatus("s-1").to_json()) or b""
    records = [
        OutRecord(topic, b"s-1/0", avro, partition=0),
        OutRecord(topic, b"s-1/1", json.dumps(legacy).encode(), partition=0),  # before Avro
        OutRecord(topic, b"s-1/2", b"\xc3\x01garbage!", partition=0),
        OutRecord(topic, b"no-slot", avro, partition=0),
        OutRecord(topic, b"s-1/3", fleet, partition=0),
        OutRecord(topic, b"s-1/4", b"\xff\xfe", partition=0),
    ]

    async def write_and_read() -> VersionContent | None:
        await ensure_topic(settings, topic, compact=True)
        await send_records(settings, records)
        return await read_version(settings, topic)

    content = asyncio.run(write_and_read())
    assert content is not None
    assert content.conversations == {"s-1": [_message("avro"), _message("legacy json")]}
    assert content.last_change == {"s-1": 1}
    assert content.undecodable == 4
    assert [line.split(": skipped")[0] for line in content.problems] == [
        f"{topic}[0]@{offset}" for offset in (2, 3, 4, 5)]
    assert "unknown writer schema fingerprint" in content.problems[0]
    assert "not '<session>/<slot>'" in content.problems[1]
    assert "a dsh.FleetStatus record where dsh.DerivedMessageChange" in content.problems[2]
    assert "not a framed Avro output record" in content.problems[3]


def test_a_confluent_framed_version_reads_back_through_the_registry(
        settings: Settings) -> None:
    """Ids resolve through the settings' registry; with the registry unreachable the records
    are skipped and counted, never a crash."""
    topic = settings.topics.derived_messages
    with RegistryClient.from_settings(settings) as client:
        codecs = output_codecs_for_topics(client, settings.topics)
    changes = [MessageChange("s-1", slot, slot, slot, "append", _message(f"m{slot}"))
               for slot in range(3)]
    records = [OutRecord(topic, c.key.encode(), codecs.derived.encode_change(c) or b"",
                         partition=0) for c in changes]

    async def write_and_read() -> VersionContent | None:
        await ensure_topic(settings, topic, compact=True)
        await send_records(settings, records)
        return await read_version(settings, topic)

    content = asyncio.run(write_and_read())
    assert content is not None and content.undecodable == 0
    assert content.conversations == {"s-1": [_message(f"m{slot}") for slot in range(3)]}
    unreachable = replace(settings, registry_url=f"http://127.0.0.1:{_closed_port()}")
    content = asyncio.run(read_version(unreachable, topic))
    assert content is not None and content.conversations == {}
    assert content.undecodable == 3 and "schema registry" in content.problems[0]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_replay_with_the_registry_reads_confluent_events_and_writes_a_confluent_version(
        settings: Settings, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in (("DSH_BOOTSTRAP_SERVERS", settings.bootstrap_servers),
                        ("DSH_REGISTRY_URL", settings.registry_url),
                        ("DSH_TOPIC_PREFIX", settings.topic_prefix),
                        ("DSH_PARTITIONS", str(settings.partitions))):
        monkeypatch.setenv(name, value)
    names = ("text-turn", "tool-call-turn")
    with RegistryClient.from_settings(settings) as client:
        serde = event_serde_for_topic(client, settings.topics.session_events)

    async def publish_confluent() -> None:
        await ensure_topics(settings)
        for name in names:
            events = read_session_file(FIXTURES / f"{name}.jsonl").events
            await send_records(settings, event_records(settings, name, events, serde))

    asyncio.run(publish_confluent())
    assert main(["replay", "--registry"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (summary["switched"], summary["log_problems"], summary["differences"]) == (
        True, 0, 0)
    values = asyncio.run(_values(settings, summary["topic"]))
    assert values and all(v is not None and v[0] == 0 for v in values)
    assert asyncio.run(derived_conversations(settings)) == {
        name: json.loads((FIXTURES / f"{name}.derived.json").read_text()) for name in names}
