"""GenAI spans of the recorded sessions, built without a broker: tree, names, attributes,
token sums against core's usage scan, deterministic ids, trace context, the OTLP encoding,
and the exporter's retry rules against a real local receiver."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from otlp_receiver import OtlpReceiver, attributes
from shared_paths import SHARED_DIR

from dsh_dev.synth import synth_session
from pipeline.adapters.otlp.client import (
    OtlpFailed,
    OtlpHttpExporter,
    OtlpRejected,
    parse_headers,
    retry_after_s,
)
from pipeline.adapters.otlp.encode import decode_request, export_request, spans_of
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import ConfigError
from pipeline.core.events import Event
from pipeline.core.genai_spans import SessionTraces, build_spans
from pipeline.core.genai_trace import Span, TraceParent
from pipeline.core.usage import UsageScan

FIXTURES = SHARED_DIR / "fixtures" / "dsh-format0"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.jsonl"))
CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def events_of(name: str) -> list[Event]:
    return read_session_file(FIXTURES / f"{name}.jsonl").events


def export_log(session_id: str, events: Sequence[Event], *, with_content: bool = False,
               traceparent: str | None = None) -> list[Span]:
    traces = SessionTraces(session_id)
    spans: list[Span] = []
    for position, event in enumerate(events):
        turn = traces.add(event, position, traceparent)
        if turn is not None:
            spans += build_spans(turn, with_content=with_content)
    return spans


@pytest.mark.parametrize("name", NAMES)
def test_fixture_spans_tree_names_and_token_sums(name: str) -> None:
    events = events_of(name)
    spans = export_log(name, events)
    turns = [e for e in events if e.type == "turn/end"]
    roots = [s for s in spans if s.operation == "invoke_agent"]
    assert len(roots) == len(turns) and all(s.parent_span_id == b"" for s in roots)
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)  # ids unique
    for span in spans:
        assert span.attributes["gen_ai.conversation.id"] == name
        assert span.end_ms >= span.start_ms
        if span.operation != "invoke_agent":
            root = by_id[span.parent_span_id]
            assert root.operation == "invoke_agent" and root.trace_id == span.trace_id
            assert root.attributes["dsh.turn"] == span.attributes["dsh.turn"]
    chats = [s for s in spans if s.operation == "chat"]
    steps = [e for e in events if e.type == "step/start"]
    assert len(chats) == len(steps)
    for chat in chats:
        assert chat.name == f"chat {chat.attributes['gen_ai.request.model']}"
        assert chat.kind == "CLIENT" and chat.attributes["gen_ai.provider.name"] != ""
    tools = [s for s in spans if s.operation == "execute_tool"]
    calls = {e.data["callId"] for e in events if e.type == "tool/call"}  # type: ignore[index]
    assert {s.attributes["gen_ai.tool.call.id"] for s in tools} >= calls
    for tool in tools:
        assert tool.name == f"execute_tool {tool.attributes['gen_ai.tool.name']}"
    scan = UsageScan()
    scan.add_log(name, events)
    expected = scan.by_session[name].otel_attributes()
    for key in ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"):
        assert sum(int(s.attributes.get(key, 0)) for s in chats) == expected[key]  # type: ignore[call-overload]
        assert sum(int(s.attributes[key]) for s in roots) == expected[key]  # type: ignore[call-overload]


def test_errors_cancels_and_repairs_carry_status_and_events() -> None:
    cancel = export_log("c", events_of("cancel"))
    root = cancel[0]
    assert root.attributes["dsh.turn.end_reason"] == "aborted" and root.error is None
    assert [e.name for e in root.events] == ["dsh.turn.cancelled"]
    assert cancel[1].attributes["gen_ai.response.finish_reasons"] == ("cancelled",)
    repaired = export_log("r", events_of("tool-outcome-unknown"))
    first = [s for s in repaired if s.attributes["dsh.turn"] == 1]
    assert first[0].error == "interrupted" and first[0].attributes["error.type"] == "interrupted"
    tool = next(s for s in first if s.operation == "execute_tool")
    assert tool.attributes["error.type"] == "TOOL_OUTCOME_UNKNOWN"


def test_retries_are_span_events_and_a_failed_turn_has_error_type() -> None:
    events = synth_session(1, 20000)
    spans = export_log("synth", events)
    retried = [s for s in spans if any(e.name == "dsh.llm.retry" for e in s.events)]
    assert retried, "the synthetic mix has provider errors with retries"
    retry = next(e for e in retried[0].events if e.name == "dsh.llm.retry")
    assert retry.attributes["dsh.retry.attempt"] == 1 and "error.type" in retry.attributes
    failed = Event("turn/start", 0, 10, {"turn": 1}), Event(
        "step/start", 1, 11, {"turn": 1, "step": 1}), Event(
        "step/end", 2, 12, {"turn": 1, "step": 1}), Event(
        "turn/end", 3, 13, {"turn": 1, "reason": {"kind": "error", "error": {
            "message": "overloaded", "code": "SERVER"}}})
    root, chat = export_log("f", failed)
    assert root.error == chat.error == "SERVER"
    assert chat.attributes["error.type"] == "SERVER"


def test_ids_are_deterministic_and_a_traceparent_becomes_the_parent() -> None:
    events = events_of("tool-call-turn")
    first, again = export_log("s", events), export_log("s", events)
    assert [(s.trace_id, s.span_id) for s in first] == [(s.trace_id, s.span_id) for s in again]
    assert {s.trace_id for s in export_log("other", events)}.isdisjoint(
        {s.trace_id for s in first})
    caller = TraceParent.parse(CALLER)
    assert caller is not None and caller.header() == CALLER
    traced = export_log("s", events, traceparent=CALLER)
    assert {s.trace_id for s in traced} == {caller.trace_id}
    assert traced[0].parent_span_id == caller.span_id
    assert [s.span_id for s in traced] == [s.span_id for s in first]
    for bad in ("", "00-" + "0" * 32 + "-b7ad6b7169203331-01", "ff-" + CALLER[3:],
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"):
        assert TraceParent.parse(bad) is None


def test_content_only_when_asked() -> None:
    events = events_of("tool-call-turn")
    plain = export_log("s", events)
    assert not any(k.startswith(("gen_ai.input", "gen_ai.output", "gen_ai.tool.call.arg"))
                   for s in plain for k in s.attributes)
    rich = export_log("s", events, with_content=True)
    chat = next(s for s in rich if s.operation == "chat")
    assert "SNAPSHOT_OK" in str(chat.attributes["gen_ai.input.messages"])
    tool = next(s for s in rich if s.operation == "execute_tool")
    assert "echo SNAPSHOT_OK" in str(tool.attributes["gen_ai.tool.call.arguments"])


def test_an_open_turn_is_held_until_it_ends() -> None:
    events = events_of("tool-call-turn")
    traces = SessionTraces("s")
    start = next(i for i, e in enumerate(events) if e.type == "turn/start")
    for position, event in enumerate(events[:-1]):
        assert traces.add(event, position) is None
    assert traces.open_since == start
    assert traces.add(events[-2], 99) is None  # a redelivery is ignored
    assert traces.add(events[-1], len(events) - 1) is not None and traces.open_since is None
    assert traces.skipped_partial == 0
    cut = SessionTraces("s")  # a turn whose turn/end never came, then the next turn
    for position, event in enumerate(events[:start + 3]):
        cut.add(event, position)
    again = [Event(e.type, e.seq + 1000, e.time, e.data) for e in events[start:]]
    ended = [cut.add(e, 1000 + i) for i, e in enumerate(again)]
    assert cut.skipped_partial == 1 and sum(t is not None for t in ended) == 1


def test_encoding_round_trips_through_opentelemetry_proto() -> None:
    spans = export_log("s", events_of("tool-call-turn"))
    decoded = spans_of(decode_request(export_request(spans)))
    assert [s.name for s in decoded] == [s.name for s in spans]
    assert [bytes(s.span_id) for s in decoded] == [s.span_id for s in spans]
    assert attributes(decoded[1])["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert decoded[1].end_time_unix_nano == spans[1].end_ms * 1_000_000


def test_header_and_retry_after_parsing() -> None:
    assert parse_headers("Authorization=Basic%20cGs6c2s=, x-team = a") == {
        "Authorization": "Basic cGs6c2s=", "x-team": "a"}
    with pytest.raises(ConfigError) as caught:
        parse_headers("Authorization Basic secretvalue")
    assert "secretvalue" not in str(caught.value)
    assert retry_after_s("7", 0.0) == 7.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:10 GMT", 1445412480.0) == 10.0
    assert retry_after_s("soon", 0.0) is None


async def test_exporter_retries_503_then_delivers_and_sorts_final_statuses() -> None:
    receiver = OtlpReceiver(unavailable_for=3)
    url = await receiver.start()
    slept: list[float] = []

    async def no_sleep(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(0)

    exporter = OtlpHttpExporter(url, {"Authorization": "Bearer abc"}, sleep=no_sleep,
                                backoff_s=0.01)
    try:
        spans = export_log("s", events_of("text-turn"))
        assert await exporter.export(export_request(spans)) == 0
        assert receiver.requests == 4 and len(slept) == 3 and len(receiver.spans) == 2
        assert receiver.headers_seen[-1]["Authorization"] == "Bearer abc"
        receiver.refuse = lambda _spans: True
        with pytest.raises(OtlpRejected):
            await exporter.export(export_request(spans))
        receiver.refuse_status = 413  # too large: refused too (the caller splits it)
        with pytest.raises(OtlpRejected) as refused:
            await exporter.export(export_request(spans))
        assert "413" in str(refused.value)
    finally:
        await exporter.close()
        await receiver.stop()
    other = OtlpReceiver()
    url = await other.start()
    wrong = OtlpHttpExporter(url + "/wrong-path", sleep=no_sleep)
    try:
        with pytest.raises(OtlpFailed) as failed:
            await wrong.export(b"")
        assert "404" in str(failed.value)
    finally:
        await wrong.close()
        await other.stop()
