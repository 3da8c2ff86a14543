"""``dsh-pipeline otel`` on the real broker, exporting to a real OTLP/HTTP receiver: the
recorded sessions' traces, no loss while the receiver answers 503, the same ids after a
restart (a turn open at the stop exported whole once it ends), a refused turn to the dead
letter topic with its reason, and a caller's traceparent."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import urllib.request
from collections.abc import Sequence

import pytest
from fanout_support import SERDE, fanout_settings
from otlp_receiver import OtlpReceiver, attributes
from processors_support import free_port, read_topic
from prometheus_client.parser import text_string_to_metric_families
from shared_paths import SHARED_DIR

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.dlq import ERROR_MESSAGE, ORIGINAL_OFFSET
from pipeline.adapters.kafka.event_stream import Start
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.records import event_headers, record_key
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.events import Event
from pipeline.core.usage import UsageScan
from pipeline.sdk import open_stream
from pipeline.services.otel.metrics import OtelMetrics
from pipeline.services.otel.run import OtelRun, serve_otel
from pipeline.services.otel.service import OtelService
from pipeline.settings import Secret, Settings

FIXTURES = SHARED_DIR / "fixtures" / "dsh-format0"
CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def fixture_logs() -> dict[str, list[Event]]:
    return {p.stem: read_session_file(p).events for p in sorted(FIXTURES.glob("*.jsonl"))}


async def publish(settings: Settings, session_id: str, events: Sequence[Event],
                  traceparent: str | None = None) -> None:
    records = [OutRecord(settings.topics.session_events, record_key(session_id),
                         SERDE.encode(session_id, e),
                         tuple(event_headers(e, traceparent=traceparent)))
               for e in events]
    await send_records(settings, records)


class Running:
    """The service in a task, with a receiver; stopped on exit."""

    def __init__(self, settings: Settings, receiver_url: str, group: str,
                 start: Start = Start.COMMITTED) -> None:
        self.settings = Settings.from_env(settings.to_env(), otlp_endpoint=receiver_url,
                                          otlp_headers=Secret("Authorization=Bearer%20s3cret"))
        self.stop = asyncio.Event()
        self.run = OtelRun(group_id=group, start=start, metrics_port=-1, backoff_s=0.02,
                           group_probe_s=0.3)
        self.metrics = OtelMetrics()
        self.task: asyncio.Task[OtelService] | None = None

    async def __aenter__(self) -> Running:
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(serve_otel(
            self.settings, SERDE.decode, self.stop, run=self.run, metrics=self.metrics,
            on_started=started))
        await asyncio.wait({started, self.task}, timeout=60,
                           return_when=asyncio.FIRST_COMPLETED)
        if self.task.done():
            self.task.result()  # the service failed to start: raise why
        assert started.done()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, 60)


@pytest.fixture
async def otel_settings(kafka_bootstrap: str, topic_prefix: str) -> Settings:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    await ensure_topics(settings)
    return settings


def sample(metrics: OtelMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


def roots(receiver: OtlpReceiver) -> list[object]:
    return receiver.by_name("invoke_agent")


@pytest.mark.broker
async def test_recorded_sessions_arrive_as_traces_with_core_token_sums(
        otel_settings: Settings, group_id: str) -> None:
    logs = fixture_logs()
    turns = sum(1 for events in logs.values() for e in events if e.type == "turn/end")
    for name, events in logs.items():
        await publish(otel_settings, name, events)
    receiver = OtlpReceiver(unavailable_for=4)  # the collector is "down" at first
    url = await receiver.start()
    try:
        async with Running(otel_settings, url, group_id) as running:
            await receiver.wait_for(lambda: len(roots(receiver)) >= turns)
        # lag, then delivery: no loss
        assert sample(running.metrics, "dsh_otel_export_retries_total") >= 4
    finally:
        await receiver.stop()
    assert len(roots(receiver)) == turns
    assert receiver.headers_seen[-1]["Authorization"] == "Bearer s3cret"
    by_id = {bytes(s.span_id): s for s in receiver.spans}
    assert len(by_id) == len(receiver.spans)
    for name, events in logs.items():
        spans = [s for s in receiver.spans
                 if attributes(s)["gen_ai.conversation.id"] == name]
        for span in spans:
            if span.name != "invoke_agent":
                parent = by_id[bytes(span.parent_span_id)]
                assert parent.name == "invoke_agent" and parent.trace_id == span.trace_id
        chats = [attributes(s) for s in spans if s.name.startswith("chat ")]
        assert len(chats) == sum(1 for e in events if e.type == "step/start")
        scan = UsageScan()
        scan.add_log(name, events)
        expected = scan.by_session[name].otel_attributes()
        for key in ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"):
            assert sum(int(a.get(key, 0)) for a in chats) == expected[key]  # type: ignore[call-overload]
    tools = [attributes(s) for s in receiver.by_name("execute_tool ")]
    assert {"bash", "read", "write_remote"} <= {a["gen_ai.tool.name"] for a in tools}


@pytest.mark.broker
async def test_a_group_left_by_its_members_shows_zero_members(
        otel_settings: Settings) -> None:
    await publish(otel_settings, "s", fixture_logs()["text-turn"])
    idle = f"{otel_settings.group_id_prefix}idle"
    async with open_stream(otel_settings, group_id=idle, start=Start.BEGINNING) as stream:
        async for record in stream:
            await stream.commit(record)
            break
    receiver = OtlpReceiver()
    url = await receiver.start()
    otel_group = f"{otel_settings.group_id_prefix}otel"
    try:
        async with Running(otel_settings, url, otel_group) as running:
            def members(group: str) -> float | None:
                return running.metrics.registry.get_sample_value(
                    "dsh_consumer_group_members", {"group": group})
            for _ in range(300):
                if members(idle) is not None and members(otel_group):
                    break
                await asyncio.sleep(0.1)
            assert members(idle) == 0 and members(otel_group) == 1
    finally:
        await receiver.stop()


@pytest.mark.broker
async def test_restart_reexports_identical_ids_and_an_open_turn_once_it_ends(
        otel_settings: Settings, group_id: str) -> None:
    events = fixture_logs()["tool-outcome-unknown"]
    cut = next(i for i, e in enumerate(events) if e.type == "turn/start" and e.seq > 0) + 3
    await publish(otel_settings, "s", events[:cut])  # turn 1 ended, turn 2 open
    receiver = OtlpReceiver()
    url = await receiver.start()
    try:
        async with Running(otel_settings, url, group_id) as first:
            await receiver.wait_for(lambda: len(roots(receiver)) == 1)
            await asyncio.sleep(1.0)  # a chance to (wrongly) export the open turn
            assert sample(first.metrics, "dsh_otel_open_turns") == 1
            assert sample(first.metrics, "dsh_otel_oldest_open_turn_seconds") > 0
        assert len(roots(receiver)) == 1
        await publish(otel_settings, "s", events[cut:])
        async with Running(otel_settings, url, group_id):  # the same group: a restart
            await receiver.wait_for(lambda: len(roots(receiver)) == 2)
        first_run = {bytes(s.span_id) for s in receiver.spans}
        assert {attributes(s)["dsh.turn"] for s in roots(receiver)} == {1, 2}
        again = OtlpReceiver()
        again_url = await again.start()
        try:  # a replay from the beginning in a new group gives the very same ids
            async with Running(otel_settings, again_url, group_id + "-replay",
                               start=Start.BEGINNING):
                await again.wait_for(lambda: len(roots(again)) == 2)
            assert {bytes(s.span_id) for s in again.spans} == first_run
            assert ({bytes(s.trace_id) for s in again.spans}
                    == {bytes(s.trace_id) for s in receiver.spans})
        finally:
            await again.stop()
    finally:
        await receiver.stop()


@pytest.mark.broker
async def test_a_refused_turn_is_dead_lettered_and_a_traceparent_is_the_parent(
        otel_settings: Settings, group_id: str) -> None:
    logs = fixture_logs()
    await publish(otel_settings, "good", logs["text-turn"], traceparent=CALLER)
    await publish(otel_settings, "bad", logs["cancel"])
    receiver = OtlpReceiver(refuse=lambda spans: any(
        attributes(s)["gen_ai.conversation.id"] == "bad" for s in spans))
    url = await receiver.start()
    try:
        async with Running(otel_settings, url, group_id) as running:
            await receiver.wait_for(lambda: len(roots(receiver)) == 1)
            dlq = otel_settings.topics.dlq(otel_settings.topics.session_events)
            letters = await read_topic(otel_settings, dlq)
            for _ in range(100):
                if letters:
                    break
                await asyncio.sleep(0.2)
                letters = await read_topic(otel_settings, dlq)
        assert sample(running.metrics, "dsh_otel_dead_letters_total") == 1
    finally:
        await receiver.stop()
    assert receiver.refused >= 1
    ((key, _value, headers),) = letters
    assert b"HTTP 400" in headers[ERROR_MESSAGE] and key == "bad"
    cancel_end = next(e for e in logs["cancel"] if e.type == "turn/end")
    assert int(headers[ORIGINAL_OFFSET]) >= cancel_end.seq
    root = roots(receiver)[0]
    assert bytes(root.trace_id).hex() == CALLER.split("-")[1]
    assert bytes(root.parent_span_id).hex() == CALLER.split("-")[2]
    assert all(bytes(s.trace_id) == bytes(root.trace_id) for s in receiver.spans)


@pytest.mark.broker
async def test_the_command_serves_health_and_metrics_and_stops_on_sigterm(
        otel_settings: Settings) -> None:
    await publish(otel_settings, "cli", fixture_logs()["tool-call-turn"])
    receiver = OtlpReceiver()
    url = await receiver.start()
    port = free_port()
    env = {**os.environ, **otel_settings.to_env(), "DSH_OTLP_ENDPOINT": url,
           "DSH_OTEL_METRICS_PORT": str(port)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli.main", "otel", "--log-level", "warning", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        await receiver.wait_for(lambda: len(roots(receiver)) == 1)
        health = json.loads(await asyncio.to_thread(http_get, port, "/health"))
        assert health["status"] == "ok" and health["turns_exported"] == 1
        metrics = await asyncio.to_thread(http_get, port, "/metrics")
        families = {f.name for f in text_string_to_metric_families(metrics)}
        assert {"gen_ai_client_token_usage", "gen_ai_client_operation_duration_seconds",
                "dsh_otel_spans_exported"} <= families
        process.send_signal(signal.SIGTERM)
        _, errors = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, errors.decode()[-2000:]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await receiver.stop()


def http_get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        return str(answer.read().decode())
