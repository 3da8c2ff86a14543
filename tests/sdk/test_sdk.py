"""The consumer SDK on the real broker: header type filters (no decoding of skipped records),
per-session catch-up, dedup of redelivered seqs, gaps raised, consumer groups, committed
offsets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from fanout_support import FIXTURES, SERDE, fanout_settings, publish

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.events import Event
from pipeline.sdk import (
    At,
    EventRecord,
    EventStream,
    SessionGap,
    Start,
    catch_up,
    open_stream,
    process_at_least_once,
)
from pipeline.settings import Settings

TEXT = read_session_file(FIXTURES / "text-turn.jsonl").events
TOOLS = read_session_file(FIXTURES / "tool-call-turn.jsonl").events
HANG_GUARD_S = 60.0  # only to turn a hang into a failure; never a speed assertion


@pytest.fixture
async def fan_settings(kafka_bootstrap: str, topic_prefix: str) -> Settings:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    await ensure_topics(settings)
    return settings


async def take(stream: AsyncIterator[EventRecord], count: int) -> list[EventRecord]:
    async def collect() -> list[EventRecord]:
        found: list[EventRecord] = []
        async for record in stream:
            found.append(record)
            if len(found) == count:
                break
        return found
    return await asyncio.wait_for(collect(), HANG_GUARD_S)


@pytest.mark.broker
async def test_type_filter_decodes_only_wanted_records_and_catch_up(
        fan_settings: Settings) -> None:
    await publish(fan_settings, "text", TEXT)
    await publish(fan_settings, "tools", TOOLS)
    decoded: list[int] = []

    def counting_decode(data: bytes) -> tuple[str, Event]:
        decoded.append(1)
        return SERDE.decode(data)

    wanted = {"turn/start", "turn/end", "tool/call"}
    expected = [e for e in (*TEXT, *TOOLS) if e.type in wanted]
    async with EventStream(fan_settings, decode=counting_decode, types=wanted,
                           dedup=True) as stream:
        records = await take(stream, len(expected))
    by_session = {sid: [r.event for r in records if r.session_id == sid]
                  for sid in ("text", "tools")}
    assert by_session == {"text": [e for e in TEXT if e.type in wanted],
                          "tools": [e for e in TOOLS if e.type in wanted]}
    assert len(decoded) == len(expected)  # chunks and the rest skipped by header

    tail = [e async for e in catch_up(fan_settings, "tools", from_seq=20)]
    assert tail == list(TOOLS[20:])
    ends = [e async for e in catch_up(fan_settings, "tools", types={"turn/end"})]
    assert ends == [e for e in TOOLS if e.type == "turn/end"]

    # At(time): only records stamped at or after it (here: a session published later)
    after = max(r.timestamp_ms for r in records) + 1
    await asyncio.sleep(0.01)  # so the next records' timestamps are past ``after``
    late = read_session_file(FIXTURES / "cancel.jsonl").events
    await publish(fan_settings, "late", late)
    async with open_stream(fan_settings, start=At(after)) as stream:
        assert [(r.session_id, r.event) for r in await take(stream, len(late))] == [
            ("late", e) for e in late]


@pytest.mark.broker
async def test_redelivered_seqs_are_skipped_and_a_gap_raises(fan_settings: Settings) -> None:
    events = list(TEXT[:6])
    await publish(fan_settings, "s", events[:4])
    await publish(fan_settings, "s", events[2:6])  # seqs 2 and 3 delivered twice
    await publish(fan_settings, "s", list(TEXT[7:8]))  # seq 6 never published: a gap
    async with open_stream(fan_settings) as stream:
        records = await take(stream, 6)
        assert [r.event for r in records] == events
        with pytest.raises(SessionGap, match=r"session 's'.*expected seq 6, found 7"):
            await take(stream, 1)
        assert stream.skipped_duplicates == 2


@pytest.mark.broker
async def test_two_groups_each_see_every_event_once_and_resume_from_commits(
        fan_settings: Settings) -> None:
    await publish(fan_settings, "text", TEXT)
    await publish(fan_settings, "tools", TOOLS)
    total = len(TEXT) + len(TOOLS)
    seen: dict[str, list[tuple[str, int]]] = {"a": [], "b": []}

    async def run_group(name: str, limit: int) -> int:
        async def handle(record: EventRecord) -> None:
            seen[name].append((record.session_id, record.event.seq))
        async with open_stream(fan_settings, group_id=f"{fan_settings.group_id_prefix}{name}",
                               start=Start.COMMITTED) as stream:
            return await asyncio.wait_for(
                process_at_least_once(stream, handle, commit_every=7, limit=limit),
                HANG_GUARD_S)

    assert await asyncio.gather(run_group("a", total), run_group("b", total)) == [total, total]
    expected = sorted([("text", e.seq) for e in TEXT] + [("tools", e.seq) for e in TOOLS])
    assert sorted(seen["a"]) == expected and sorted(seen["b"]) == expected
    # group a resumes after its commits: only what is published later
    more = read_session_file(FIXTURES / "cancel.jsonl").events
    await publish(fan_settings, "more", more)
    seen["a"].clear()
    assert await run_group("a", len(more)) == len(more)
    assert seen["a"] == [("more", e.seq) for e in more]
