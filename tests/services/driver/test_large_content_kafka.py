"""Large content on the real broker: one record limit, spilled tool results, big follow-ups.

The driver runs in-process with the scripted provider and a ``blob`` tool that returns a
text of the size asked for; the session topic is read back read_committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from processors_support import Worker, free_port
from test_driver_kafka import (
    PARTITIONS,
    WAIT_S,
    completed_turns,
    partition_of,
    send_followup,
    strict_log,
    wait_for_events,
)

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.event_stream import partitions_of
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord, RecordTooLargeError, header_value
from pipeline.adapters.kafka.spill import (
    COUNT_HEADER,
    INDEX_HEADER,
    SHA_HEADER,
    SpillRef,
    chunks_of,
    save_spill,
)
from pipeline.adapters.kafka.spill import partition_of as spill_partition
from pipeline.adapters.llm.scripted import ScriptedReply, echo_script, tool_loop_script
from pipeline.cli.cmd_driver import driver_context
from pipeline.cli.main import main
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.core.errors import CodecError
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.model import ModelRequest
from pipeline.sdk import derived_conversations, read_spill, spill_refs
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.tools import ECHO, ToolRegistry, ToolSpec
from pipeline.services.replay.transfer import export_session
from pipeline.settings import Settings

pytestmark = [pytest.mark.broker, pytest.mark.timeout(600)]
MIB = 1024 * 1024


def blob_text(size: int) -> str:
    """``size`` bytes of numbered lines (ASCII), different at every position."""
    line_count = size // 20 + 1
    return "".join(f"blob line {n:09d} ok\n" for n in range(line_count))[:size]


async def _blob(args: dict[str, Any]) -> str:
    return blob_text(int(args["bytes"]))


BLOB = ToolSpec("blob", "Return a text of the given size.",
                {"type": "object", "properties": {"bytes": {"type": "integer", "minimum": 0}},
                 "required": ["bytes"], "additionalProperties": False},
                _blob, timeout_s=120.0)


def large_settings(bootstrap: str, prefix: str, **changes: Any) -> Settings:
    return Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                             partitions=PARTITIONS, replication_factor=1,
                             group_id_prefix=f"{prefix}g-", **changes)


@pytest.fixture
async def big(kafka_bootstrap: str, topic_prefix: str) -> Settings:
    settings = large_settings(kafka_bootstrap, topic_prefix)
    await ensure_topics(settings)
    return settings


@pytest.fixture
async def small(kafka_bootstrap: str, topic_prefix: str) -> Settings:
    """A 1 MiB record limit: the smallest the settings allow."""
    settings = large_settings(kafka_bootstrap, topic_prefix, max_record_bytes=MIB,
                              spill_inline_bytes=50_000)
    await ensure_topics(settings)
    return settings


@contextlib.asynccontextmanager
async def driving(settings: Settings, script: Any) -> AsyncIterator[DriverService]:
    ctx = driver_context(settings, group_id=f"{settings.group_id_prefix}driver",
                         tools=ToolRegistry([BLOB, ECHO]), linger_ms=10, script=script)
    service = DriverService(ctx, DriverConfig(linger_ms=10, shutdown_grace_s=5,
                                              session_timeout_ms=6000))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


async def topic_records(settings: Settings, topic: str) -> list[Any]:
    consumer = AIOKafkaConsumer(**client_options(settings), enable_auto_commit=False,
                                isolation_level="read_committed", auto_offset_reset="earliest",
                                max_partition_fetch_bytes=64 * MIB)
    await consumer.start()
    try:
        tps = await partitions_of(consumer, topic)
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        found: list[Any] = []
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                found += batch
        return found
    finally:
        await consumer.stop()


def tool_result_text(event: Event) -> str:
    block = event.data["message"]["content"][0]  # type: ignore[index]
    return str(block["content"][0]["text"])  # type: ignore[index]


@pytest.mark.parametrize("size", [5_000_000, 40_000_000], ids=["5MB", "40MB"])
async def test_an_oversized_tool_result_is_spilled_and_stays_retrievable(
        big: Settings, tmp_path: Path, size: int) -> None:
    session = f"s-blob-{size}"
    script = tool_loop_script("blob", json.dumps({"bytes": size}))
    async with driving(big, script):
        await send_followup(big, session, "produce a large result")
        events = await wait_for_events(big, session, lambda ev: completed_turns(ev) == 1)
    strict_log(session, events)  # every event whole and valid
    [result] = [e for e in events if e.type == "tool/result"]
    seen = tool_result_text(result)   # what the model got (derived = what the log holds)
    full = blob_text(size)
    assert len(seen.encode()) <= big.spill_inline_bytes
    preview, notice = seen.rsplit("\n\n", 1)
    head = len(preview) - len(preview) // 2
    assert full.startswith(preview[:head]) and full.endswith(preview[head:])
    ref = SpillRef.from_meta(result.data["meta"])  # type: ignore[union-attr]
    assert ref is not None and ref.bytes == size and ref.chunks == -(-size // 1_000_000)
    assert notice.startswith(f"(Omitted {size - len(preview)} bytes. Full formatted result "
                             f"stored at: {ref.locator}. ")
    answer = [e for e in events if e.type == "assistant/message"][-1]
    assert answer.data["message"]["content"][-1]["text"] == f"Done: {seen[:200]}"  # type: ignore[index]
    assert await read_spill(big, ref) == full
    if size < 10_000_000:  # by locator and by bare hash too (a scan of the partition)
        assert await read_spill(big, ref.locator) == full
        assert await read_spill(big, ref.sha256) == full
    assert spill_refs(events) == [ref]
    spill_records = await topic_records(big, big.topics.spill)
    assert len(spill_records) == ref.chunks
    assert max(len(r.value) for r in spill_records) <= 1_000_000
    await export_session(big, session, tmp_path / "s.jsonl", EventSerde().decode,
                         spill_dir=tmp_path / "spill")
    assert (tmp_path / "spill" / f"{ref.sha256}.txt").read_text() == full


async def test_a_2mb_followup_is_logged_whole_and_its_derived_message_served(
        big: Settings, tmp_path: Path) -> None:
    session, text = "s-big-followup", blob_text(2_000_000)
    async with driving(big, echo_script):
        await send_followup(big, session, text)
        events = await wait_for_events(big, session, lambda ev: completed_turns(ev) == 1)
    strict_log(session, events)
    [user] = [e for e in events if e.type == "user/message"]
    assert user.data["content"] == [{"type": "text", "text": text}]  # type: ignore[index]
    worker = Worker(big, free_port(), tmp_path / "state")
    try:
        worker.wait_ready()
        deadline = time.monotonic() + WAIT_S
        conversations: dict[str, Any] = {}
        while time.monotonic() < deadline and len(conversations.get(session, ())) < 2:
            conversations = await derived_conversations(big)
            await asyncio.sleep(0.5)
        first = conversations[session][0]
        assert first["content"] == [{"type": "text", "text": text}]
        assert "dead" not in worker.tail().lower()
    finally:
        worker.stop()


async def test_a_followup_too_large_for_the_inbox_is_refused_at_send(
        small: Settings, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    command = FollowUp("s-refused", "m-1", ({"type": "text", "text": blob_text(2_000_000)},))
    record = OutRecord(small.topics.inbox, b"s-refused", InboxCodec().encode(command))
    with pytest.raises(RecordTooLargeError, match=r"the command for session 's-refused' "
                                                   r"\(content included\) is 2,0\d\d,\d\d\d "
                                                   r"bytes.*limit of 983,040 bytes"):
        await send_records(small, [record])
    for name, value in small.to_env().items():
        monkeypatch.setenv(name, value)
    assert await asyncio.to_thread(main, ["send", "s-refused", "--followup",
                                          blob_text(2_000_000)]) == 1  # invalid input
    error = capsys.readouterr().err
    assert "DSH_MAX_RECORD_BYTES" in error and "nothing was written" in error
    assert await topic_records(small, small.topics.inbox) == []


async def test_an_oversized_inbox_record_is_dead_lettered_and_the_session_goes_on(
        small: Settings) -> None:
    session = "s-bypass"
    command = FollowUp(session, "m-big", ({"type": "text", "text": blob_text(1_000_000)},))
    producer = AIOKafkaProducer(**client_options(small), max_request_size=MIB)
    await producer.start()
    try:  # a client without the size check: the broker takes it (below its 1 MiB)
        await producer.send_and_wait(small.topics.inbox, InboxCodec().encode(command),
                                     key=session.encode())
    finally:
        await producer.stop()
    async with driving(small, echo_script):
        await send_followup(small, session, "a normal one")
        events = await wait_for_events(small, session, lambda ev: completed_turns(ev) == 1)
    assert [e.data["content"][0]["text"] for e in events  # type: ignore[index]
            if e.type == "user/message"] == ["a normal one"]
    [dead] = await topic_records(small, small.topics.dlq(small.topics.inbox))
    assert b"record-too-large" in (header_value(dead.headers, "dsh.error.message") or b"")


def _big_or_echo(request: ModelRequest, attempt: int) -> ScriptedReply:
    last = request.messages[-1]
    text = last["content"][0]["text"] if isinstance(last, dict) else ""  # type: ignore[index]
    if text == "answer hugely":
        return ScriptedReply(text=blob_text(MIB + MIB // 2))
    return echo_script(request, attempt)


async def test_an_event_above_the_limit_fails_its_session_alone(small: Settings) -> None:
    big_one = "s-huge-answer"
    neighbour = next(f"s-next-{n}" for n in range(100)
                     if partition_of(f"s-next-{n}") == partition_of(big_one))
    async with driving(small, _big_or_echo) as service:
        await send_followup(small, big_one, "answer hugely")
        await asyncio.sleep(1.0)
        await send_followup(small, neighbour, "hello")
        events = await wait_for_events(small, neighbour, lambda ev: completed_turns(ev) == 1)
        assert service.metrics_snapshot()["session_failures"] == 1
    assert any(e.type == "assistant/message" for e in events)
    huge = await wait_for_events(small, big_one, lambda ev: bool(ev))
    assert not any(e.type == "assistant/message" for e in huge)
    strict_log(big_one, huge)  # what was written is whole; the turn is repaired on restart
    assert all(len(r.value) <= small.max_record_bytes
               for r in await topic_records(small, small.topics.session_events))


async def test_a_partly_spilled_text_is_never_returned_as_whole(big: Settings) -> None:
    text = blob_text(2_500_000)
    data = text.encode()
    sha = hashlib.sha256(data).hexdigest()
    pieces = chunks_of(data)
    partitions = big.partitions
    # what a driver killed between chunks leaves: the first two of three chunks
    await send_records(big, [
        OutRecord(big.topics.spill, f"{sha}:{i}".encode(), piece,
                  ((SHA_HEADER, sha.encode()), (INDEX_HEADER, str(i).encode()),
                   (COUNT_HEADER, str(len(pieces)).encode())),
                  spill_partition(sha, partitions))
        for i, piece in enumerate(pieces[:2])])
    with pytest.raises(CodecError, match=r"incomplete copy .*\(2 chunk\(s\), 2,000,000 bytes\)"):
        await read_spill(big, sha)
    ref = await save_spill(big, text)   # spilled again whole: the same keys, now complete
    assert ref.sha256 == sha and ref.chunks == 3
    assert await read_spill(big, sha) == text
    with pytest.raises(CodecError, match="no chunk"):
        await read_spill(big, "0" * 64)
