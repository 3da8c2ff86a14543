"""Driver-run sessions to traces: a caller's W3C ``traceparent`` on an inbox follow-up is
carried into the record headers of the turn it starts (only that turn), and the otel
service exports the driver's turns under the caller's span, token sums as core counts."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import pytest
from fanout_support import SERDE, fanout_settings
from otlp_receiver import OtlpReceiver, attributes
from shared_paths import SHARED_DIR
from test_otel_broker import Running

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord, header_value
from pipeline.adapters.kafka.session_reader import read_session_partition
from pipeline.adapters.llm.scripted import echo_script
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.inbox import InboxCodec
from pipeline.codec.records import HEADER_TRACEPARENT, event_headers
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.inbox import FollowUp
from pipeline.core.usage import UsageScan
from pipeline.sdk import partition_for, session_records
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Settings

pytestmark = [pytest.mark.broker, pytest.mark.timeout(300)]
CALLER = "00-5bf92f3577b34da6a3ce929d0e0e4736-10f067aa0ba902b7-01"
WAIT_S = 60.0


async def send_followup(settings: Settings, session_id: str, text: str,
                        traceparent: str | None = None) -> None:
    command = FollowUp(session_id, str(uuid.uuid4()), ({"type": "text", "text": text},))
    headers = ((HEADER_TRACEPARENT, traceparent.encode()),) if traceparent else ()
    await send_records(settings, [OutRecord(settings.topics.inbox, session_id.encode(),
                                            InboxCodec().encode(command), headers)])


async def turn_ends(settings: Settings, session_id: str) -> int:
    contents = await read_session_partition(
        settings, settings.topics.session_events,
        partition_for(session_id, settings.partitions), SERDE.decode)
    return sum(1 for e in contents.events.get(session_id, []) if e.type == "turn/end")


async def test_a_turn_closed_by_crash_repair_is_exported_with_the_repaired_end(
        kafka_bootstrap: str, topic_prefix: str, group_id: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    await ensure_topics(settings)
    fixture = read_session_file(SHARED_DIR / "fixtures/dsh-format0/tool-outcome-unknown.jsonl")
    opened = [replace(e, time=1_000 + e.seq) for e in fixture.events[:5]]  # crashed mid-tool
    await send_records(settings, [OutRecord(
        settings.topics.session_events, b"crashed", SERDE.encode("crashed", e),
        tuple(event_headers(e))) for e in opened])
    receiver = OtlpReceiver()
    url = await receiver.start()
    try:
        async with Running(settings, url, group_id + "-otel") as running:
            for _ in range(100):  # the exporter holds the open turn
                if running.metrics.registry.get_sample_value("dsh_otel_open_turns") == 1:
                    break
                await asyncio.sleep(0.1)
            assert not receiver.spans
            before_repair_ms = time.time() * 1000
            ctx = driver_context(settings, group_id=group_id, tools=builtin_registry(),
                                 linger_ms=10, script=echo_script)
            driver = DriverService(ctx, DriverConfig(linger_ms=10, shutdown_grace_s=5,
                                                     session_timeout_ms=6000))
            stop = asyncio.Event()
            task = asyncio.create_task(driver.run(stop))
            try:
                await receiver.wait_for(lambda: len(receiver.by_name("invoke_agent")) == 1)
            finally:
                stop.set()
                await asyncio.wait_for(task, WAIT_S)
    finally:
        await receiver.stop()
    (root,) = receiver.by_name("invoke_agent")
    assert root.status.message == "interrupted"
    assert attributes(root)["dsh.turn.end_reason"] == "interrupted"
    assert root.start_time_unix_nano == 1_000 * 1_000_000  # the logged turn/start
    assert root.end_time_unix_nano >= before_repair_ms * 1_000_000  # the repair's end
    (tool,) = receiver.by_name("execute_tool ")
    assert attributes(tool)["error.type"] == "TOOL_OUTCOME_UNKNOWN"


async def test_traceparent_of_a_follow_up_reaches_its_turn_and_its_trace(
        kafka_bootstrap: str, topic_prefix: str, group_id: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    await ensure_topics(settings)
    ctx = driver_context(settings, group_id=group_id, tools=builtin_registry(), linger_ms=10,
                         script=echo_script)
    driver = DriverService(ctx, DriverConfig(linger_ms=10, shutdown_grace_s=5,
                                             session_timeout_ms=6000))
    stop = asyncio.Event()
    task = asyncio.create_task(driver.run(stop))
    try:
        await send_followup(settings, "traced", "first, from a traced caller", CALLER)

        async def ended(count: int) -> None:
            while await turn_ends(settings, "traced") < count:
                assert not task.done()
                await asyncio.sleep(0.2)
        await asyncio.wait_for(ended(1), WAIT_S)
        await send_followup(settings, "traced", "second, untraced")
        await asyncio.wait_for(ended(2), WAIT_S)
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)

    records = [r async for r in session_records(settings, "traced", decode=SERDE.decode)]
    first_end = next(i for i, r in enumerate(records) if r.event.type == "turn/end")
    first_start = next(i for i, r in enumerate(records) if r.event.type == "turn/start")
    traced = [header_value(r.headers, HEADER_TRACEPARENT) for r in records]
    assert all(t == CALLER.encode() for t in traced[first_start:first_end + 1])
    assert not any(traced[first_end + 1:])  # the untraced follow-up's turn carries none

    receiver = OtlpReceiver()
    url = await receiver.start()
    try:
        async with Running(settings, url, group_id + "-otel"):
            await receiver.wait_for(lambda: len(receiver.by_name("invoke_agent")) == 2)
    finally:
        await receiver.stop()
    first, second = sorted(receiver.by_name("invoke_agent"),
                           key=lambda s: attributes(s)["dsh.turn"])
    assert bytes(first.trace_id).hex() == CALLER.split("-")[1]
    assert bytes(first.parent_span_id).hex() == CALLER.split("-")[2]
    assert bytes(second.parent_span_id) == b"" and second.trace_id != first.trace_id
    chats = [attributes(s) for s in receiver.by_name("chat ")]
    assert {a["gen_ai.provider.name"] for a in chats} == {settings.provider}
    scan = UsageScan()
    scan.add_log("traced", [r.event for r in records])
    expected = scan.by_session["traced"].otel_attributes()
    for key in ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"):
        assert sum(int(a.get(key, 0)) for a in chats) == expected[key]  # type: ignore[call-overload]
