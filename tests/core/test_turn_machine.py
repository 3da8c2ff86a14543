"""The turn state machine, driven synchronously: fixtures replayed, every end reason."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
from test_turn_machine_harness import (
    CONFIG,
    Attempt,
    Harness,
    counter_ids,
    fixture_events,
    new_machine,
    text_reply,
    tool_reply,
)

from pipeline.core.errors import (
    ConfigError,
    EventError,
    InvariantViolation,
    ProviderError,
    TurnError,
)
from pipeline.core.events import Event
from pipeline.core.inbox import Cancel, Configure, FollowUp, Inject, Steer
from pipeline.core.log import SessionLog, derive_messages
from pipeline.core.model import ModelRequest
from pipeline.core.turn_effects import CallModel, HookDecision, RunTools, SessionConfig, ToolOutcome
from pipeline.core.turn_machine import TurnMachine

# Events dsh plugins write that this driver does not (title, runtime-context snapshots).
PLUGIN_ONLY = {"session/title"}


def follow_up(text: str, message_id: str = "m1") -> FollowUp:
    return FollowUp("s1", message_id, ({"type": "text", "text": text},))


def types(events: Sequence[Event]) -> list[str]:
    return [e.type for e in events]


def normalized(events: Sequence[Event]) -> list[dict[str, Any]]:
    """Events as comparable JSON: ids and times dropped, sources as positions in the list."""
    position = {e.seq: i for i, e in enumerate(events)}
    out = []
    for event in events:
        data = copy.deepcopy(event.data)
        message = data.get("message") if isinstance(data, dict) else None
        if isinstance(message, dict):
            message.pop("id", None)
        if event.type == "request/header":
            data["header"].pop("tools", None)
        item: dict[str, Any] = {"type": event.type, "data": data}
        if event.source_event_seqs is not None:
            item["sources"] = [position.get(s, f"outside:{s}") for s in event.source_event_seqs]
        if event.surface_op is not None:
            item["surfaceOp"] = event.surface_op
        out.append(item)
    return out


def is_plugin_context(event: Event) -> bool:
    """A user/message a dsh plugin added (runtime context): not something we produce."""
    return event.type == "user/message" and event.data["source"]["kind"] != "user"


def replay_fixture(name: str) -> tuple[list[Event], list[Event], Harness]:
    """Drive the machine with the fixture's own user input, chunks and tool results."""
    recorded = [e for e in fixture_events(name)
                if e.type not in PLUGIN_ONLY and not is_plugin_context(e)]
    first_user = next(e for e in recorded if e.type == "user/message")
    command = FollowUp("s1", first_user.data["id"], tuple(first_user.data["content"]))
    chunks_by_step: dict[int, list[dict[str, Any]]] = {}
    for event in recorded:
        if event.type == "assistant/chunk":
            chunks_by_step.setdefault(event.data["step"], []).append(event.data["chunk"])
    outcomes = {}
    for event in recorded:
        if event.type == "tool/result":
            block = event.data["message"]["content"][0]
            outcomes[block["toolCallId"]] = ToolOutcome(tuple(block["content"]),
                                                        block.get("isError", False),
                                                        meta=event.data.get("meta"))
    machine = new_machine()
    harness = Harness(machine, iter(Attempt(chunks_by_step[s]) for s in sorted(chunks_by_step)),
                      tool_outcomes=outcomes)
    machine.submit(command, harness.now())
    return recorded, harness.run(), harness


@pytest.mark.parametrize("name", ["text-turn", "tool-call-turn"])
def test_replaying_a_fixture_gives_its_events(name: str) -> None:
    recorded, produced, harness = replay_fixture(name)
    assert normalized(produced) == normalized(recorded)
    # the requests were exactly the log's derived messages at the time of each call
    assert len(harness.requests) == sum(1 for e in produced if e.type == "step/start")
    assert harness.requests[-1].provider == "deepseek-official"


def test_replay_validates_and_derives_like_the_fixture() -> None:
    _, produced, harness = replay_fixture("tool-call-turn")
    assert derive_messages(produced, mode="strict") == harness.machine.log.messages()
    roles = [m["role"] for m in harness.machine.log.messages()]
    assert roles == ["user", "assistant", "user", "assistant"]
    # the second request held everything before it: user, assistant tool call, tool result
    assert len(harness.requests[1].messages) == 3


def run_turn(*attempts: Attempt, machine: TurnMachine | None = None,
             command: FollowUp | None = None, **kwargs: Any) -> tuple[list[Event], Harness]:
    machine = machine or new_machine()
    harness = Harness(machine, iter(attempts), **kwargs)
    machine.submit(command or follow_up("hello"), harness.now())
    return harness.run(), harness


def end_reason(events: Sequence[Event]) -> dict[str, Any]:
    ends = [e for e in events if e.type == "turn/end"]
    assert ends, types(events)
    reason: dict[str, Any] = ends[-1].data["reason"]
    return reason


def test_text_turn_completes_with_boundaries() -> None:
    events, harness = run_turn(Attempt(text_reply("hi")))
    assert types(events) == [
        "agent/inbox/spliced", "turn/start", "agent/inbox/spliced", "step/start",
        "user/message", "request/header", "request/context", *["assistant/chunk"] * 5,
        "assistant/message", "step/end", "turn/end"]
    assert end_reason(events) == {"kind": "completed"}
    assert events[5].data["reason"] == "initial"
    assert harness.boundaries == 2  # step/end and turn/end are flush points
    message = events[12]
    assert message.source_event_seqs == tuple(range(7, 12))
    assert message.data["usage"] == {"inputTokens": 10, "outputTokens": 2}


def test_header_is_logged_only_when_it_changes() -> None:
    machine = new_machine()
    first, _ = run_turn(Attempt(text_reply("a")), machine=machine)
    second, _ = run_turn(Attempt(text_reply("b")), machine=machine,
                         command=follow_up("again", "m2"))
    assert "request/header" in types(first) and "request/header" not in types(second)
    machine.submit(Configure("s1", "c1", model="deepseek-v4-pro", max_tokens=100), 5)
    third, harness = run_turn(Attempt(text_reply("c")), machine=machine,
                              command=follow_up("more", "m3"))
    header = next(e for e in third if e.type == "request/header")
    assert header.data == {"header": {"config": {"provider": "deepseek-official",
                                                 "model": "deepseek-v4-pro", "maxTokens": 100},
                                      "system": "{{system}}"}, "reason": "change"}
    assert harness.requests[0].model == "deepseek-v4-pro"
    assert harness.requests[0].max_tokens == 100


def test_a_rebuilt_machine_keeps_the_logged_header_over_its_default() -> None:
    machine = new_machine()
    machine.submit(Configure("s1", "c1", model="configured-model"), 1)
    events, _ = run_turn(Attempt(text_reply("a")), machine=machine)
    rebuilt = new_machine(SessionLog.from_events("s1", events),
                          config=SessionConfig("deepseek-official", "default-model"))
    later, harness = run_turn(Attempt(text_reply("b")), machine=rebuilt,
                              command=follow_up("x", "m2"))
    assert "request/header" not in types(later)
    assert harness.requests[0].model == "configured-model"


def test_a_rebuilt_machine_logs_a_header_it_cannot_reuse_as_resume() -> None:
    # the fixture's header has a placeholder where the tool definitions were
    rebuilt = new_machine(SessionLog.from_events("s1", fixture_events("text-turn")))
    later, _ = run_turn(Attempt(text_reply("b")), machine=rebuilt,
                        command=follow_up("x", "m2"))
    header = next(e for e in later if e.type == "request/header")
    assert header.data["reason"] == "resume"
    assert header.data["header"]["config"]["model"] == "deepseek-v4-flash"


def test_bad_messages_are_refused_before_anything_is_logged() -> None:
    machine = new_machine()
    with pytest.raises(EventError):
        machine.submit(FollowUp("s1", "m1", ({"type": "text"},)), 1)  # text without text
    assert machine.take_events() == []
    machine.submit(follow_up("fine"), 2)
    harness = Harness(machine, iter([Attempt(text_reply("a"))]),
                      hook=lambda e: HookDecision(({"role": "user"},)))
    with pytest.raises(EventError):
        harness.run()
    assert "step/start" not in types(machine.log.events)


def test_tool_calls_lead_to_another_step_and_results_follow_model_order() -> None:
    def out_of_order(harness: Harness, effect: RunTools) -> bool:
        m = harness.machine
        for call in effect.calls:
            m.tool_started(call.call_id, harness.now())
        for call in reversed(effect.calls):  # the second finishes first
            m.tool_finished(call.call_id, harness.outcome(call.call_id), harness.now())
        return False

    events, _ = run_turn(
        Attempt(tool_reply(("c1", "echo", '{"text":"a"}'), ("c2", "echo", '{"text":"b"}'))),
        Attempt(text_reply("done")), on_tools=out_of_order)
    kinds = types(events)
    first_result = kinds.index("tool/result")
    assert kinds[first_result - 2:first_result + 2] == [
        "tool/call", "tool/call", "tool/result", "tool/result"]
    results = [e for e in events if e.type == "tool/result"]
    assert [r.data["message"]["source"]["callId"] for r in results] == ["c1", "c2"]
    calls = {e.data["callId"]: e.seq for e in events if e.type == "tool/call"}
    assert [r.source_event_seqs for r in results] == [(calls["c1"],), (calls["c2"],)]
    assert kinds.count("step/start") == 2 and end_reason(events) == {"kind": "completed"}


def test_max_tokens_ends_the_turn_and_does_not_continue() -> None:
    # the answer was cut inside a tool call: the call is not run, no step follows
    chunks = [*tool_reply(("c1", "echo", '{"text":'))[:-1],
              {"type": "finish", "reason": {"kind": "max-tokens"}}]
    events, harness = run_turn(Attempt(chunks), Attempt(text_reply("never")))
    assert end_reason(events) == {"kind": "max-tokens"}
    assert types(events).count("step/start") == 1 and len(harness.requests) == 1
    result = next(e for e in events if e.type == "tool/result")  # the truncated call closed
    assert result.data["error"]["code"] == "TOOL_NOT_STARTED"
    assert result.source_event_seqs is None


def test_empty_successful_answer_is_still_an_assistant_message() -> None:
    chunks = [{"type": "finish", "reason": {"kind": "stop"}}]
    events, _ = run_turn(Attempt(chunks))
    message = next(e for e in events if e.type == "assistant/message")
    assert message.data["message"]["content"] == []
    assert "usage" not in message.data
    assert end_reason(events) == {"kind": "completed"}


def test_retries_are_logged_and_rerequested_in_the_same_step() -> None:
    failure = ProviderError("overloaded", code="SERVER", status=503, request_id="r1")
    events, harness = run_turn(
        Attempt(text_reply("par")[:2], error=failure), Attempt([], error=failure),
        Attempt(text_reply("ok")))
    kinds = types(events)
    assert kinds.count("step/start") == 1 and kinds.count("assistant/message") == 1
    assert kinds.count("llm/retry") == 2 and kinds.count("llm/retry-started") == 2
    finishes = [e.data["chunk"] for e in events if e.type == "assistant/chunk"
                and e.data["chunk"]["type"] == "finish"]
    assert finishes[0] == {"type": "finish", "reason": {"kind": "error", "failure": {
        "message": "overloaded", "code": "SERVER", "status": 503, "requestId": "r1"}}}
    message = next(e for e in events if e.type == "assistant/message")
    last_started = max(e.seq for e in events if e.type == "llm/retry-started")
    assert min(message.source_event_seqs) > last_started  # only the last attempt's chunks
    assert harness.sleeps == [250, 500] and end_reason(events) == {"kind": "completed"}


def test_retries_exhausted_end_the_turn_with_the_error() -> None:
    failure = ProviderError("slow down", code="RATE_LIMIT", status=429, retry_after_ms=10)
    events, harness = run_turn(*[Attempt([], error=failure)] * 4)
    assert "assistant/message" not in types(events)
    assert types(events)[-2:] == ["step/end", "turn/end"]
    assert end_reason(events) == {"kind": "error", "error": {
        "message": "slow down", "code": "RATE_LIMIT", "status": 429,
        "providerRetryAfterMs": 10}}
    assert len(harness.requests) == 4


def test_a_non_retriable_error_ends_at_once() -> None:
    events, harness = run_turn(Attempt([], error=ProviderError("bad key", code="AUTH",
                                                               status=401)))
    assert end_reason(events)["error"]["code"] == "AUTH" and len(harness.requests) == 1
    assert "llm/retry" not in types(events)


def test_cancel_mid_stream_stores_what_was_seen() -> None:
    chunks = text_reply("partial")
    events, _ = run_turn(Attempt(chunks, cancel_after=2))
    kinds = types(events)
    assert kinds[-5:] == ["assistant/chunk", "assistant/chunk", "assistant/message",
                          "step/end", "turn/end"]
    message = events[-3]
    assert message.data["interrupted"] is True
    assert message.data["message"]["content"] == [{"type": "text", "text": "partial"}]
    assert message.source_event_seqs == (events[-5].seq, events[-4].seq)
    assert end_reason(events) == {"kind": "aborted", "reason": {"kind": "user"}}


def test_cancel_fixture_shape_is_reproduced() -> None:
    recorded = [e for e in fixture_events("cancel")
                if e.type not in PLUGIN_ONLY and not is_plugin_context(e)]
    chunks = [e.data["chunk"] for e in recorded if e.type == "assistant/chunk"]
    user = next(e for e in recorded if e.type == "user/message")
    events, _ = run_turn(Attempt([*chunks, {"type": "text-delta", "index": 0, "text": "x"}],
                                 cancel_after=len(chunks)),
                         command=FollowUp("s1", user.data["id"], tuple(user.data["content"])))
    assert normalized(events) == normalized(recorded)


def test_cancel_during_tools_drains_started_and_closes_unstarted() -> None:
    def start_one_then_cancel(harness: Harness, effect: RunTools) -> bool:
        m = harness.machine
        first = effect.calls[0]
        m.tool_started(first.call_id, harness.now())
        m.submit(Cancel("s1", "x1"), harness.now())
        with pytest.raises(TurnError):
            m.tool_started(effect.calls[1].call_id, harness.now())
        m.tool_finished(first.call_id, harness.outcome(first.call_id), harness.now())
        return False

    events, _ = run_turn(Attempt(tool_reply(("c1", "echo", "{}"), ("c2", "echo", "{}"))),
                         on_tools=start_one_then_cancel)
    results = [e for e in events if e.type == "tool/result"]
    assert [r.data.get("error") for r in results] == [
        None, {"name": "ToolCanceledError", "code": "TOOL_CANCELED"}]
    assert types(events)[-2:] == ["step/end", "turn/end"]
    assert end_reason(events) == {"kind": "aborted", "reason": {"kind": "user"}}
    assert SessionLog.from_events("s1", events).turn.open_calls == ()


def test_cancel_without_keep_queue_drops_queued_items() -> None:
    machine = new_machine()
    machine.submit(follow_up("one", "m1"), 1)
    machine.submit(follow_up("two", "m2"), 2)
    machine.submit(Inject("s1", "i1", ({"type": "text", "text": "ctx"},)), 3)
    machine.submit(Cancel("s1", "c1"), 4)
    events = machine.take_events()
    assert [e.data for e in events[-2:]] == [
        {"target": "next-turn", "start": 0, "removedCount": 2, "inserted": [],
         "outcome": "canceled"},
        {"target": "next-step", "start": 0, "removedCount": 1, "inserted": [],
         "outcome": "canceled"}]
    assert Harness(machine, iter(())).run() == []  # nothing left to wake


def test_claim_order_next_step_items_then_one_follow_up() -> None:
    machine = new_machine()
    machine.submit(follow_up("first", "m1"), 1)
    machine.submit(follow_up("second", "m2"), 2)
    machine.submit(Inject("s1", "i1", ({"type": "text", "text": "ctx"},)), 3)
    events = Harness(machine, iter([Attempt(text_reply("a")), Attempt(text_reply("b"))])).run()
    turn1 = events[:events.index(next(e for e in events if e.type == "turn/end")) + 1]
    splices = [e.data for e in turn1 if e.type == "agent/inbox/spliced"]
    assert splices[-2:] == [
        {"target": "next-step", "start": 0, "removedCount": 1, "inserted": []},
        {"target": "next-turn", "start": 0, "removedCount": 1, "inserted": []}]
    users = [e.data["id"] for e in turn1 if e.type == "user/message"]
    assert users == ["i1", "m1"]
    assert types(events).count("turn/start") == 2  # the second follow-up got its own turn


def test_inject_waits_for_a_wake_and_steer_continues_the_turn() -> None:
    machine = new_machine()
    machine.submit(Inject("s1", "i1", ({"type": "text", "text": "ctx"},)), 1)
    assert types(Harness(machine, iter(())).run()) == ["agent/inbox/spliced"]  # no wake
    harness = Harness(machine, iter([Attempt(text_reply("a")), Attempt(text_reply("b"))]))
    machine.submit(Steer("s1", "st1", ({"type": "text", "text": "go"},)), 2)
    machine.take_events()
    events = harness.run()
    assert types(events).count("turn/start") == 1
    assert [e.data["id"] for e in events if e.type == "user/message"] == ["i1", "st1"]


def test_steer_arriving_mid_turn_enters_at_the_next_step() -> None:
    machine = new_machine()

    def steer_then_answer(harness: Harness, effect: RunTools) -> bool:
        harness.machine.submit(Steer("s1", "st1", ({"type": "text", "text": "also"},)), 5)
        return True

    events, _ = run_turn(Attempt(text_reply("a")), Attempt(text_reply("b")), machine=machine)
    assert types(events).count("step/start") == 1
    events, _ = run_turn(Attempt(tool_reply(("c1", "echo", "{}"))), Attempt(text_reply("b")),
                         machine=machine, command=follow_up("t2", "m2"),
                         on_tools=steer_then_answer)
    kinds = types(events)
    second_step = kinds.index("step/start", kinds.index("step/end"))
    assert kinds[second_step - 1] == "agent/inbox/spliced"
    assert events[second_step + 1].data["id"] == "st1"


def test_rejected_first_claim_closes_a_stepless_blocked_turn() -> None:
    events, harness = run_turn(
        Attempt(text_reply("never")),
        hook=lambda effect: HookDecision((), rejected=True, reason="not allowed"))
    assert types(events) == ["agent/inbox/spliced", "turn/start", "agent/inbox/spliced",
                             "turn/end"]
    assert end_reason(events) == {"kind": "blocked"} and harness.requests == []


def test_hook_rejection_later_in_a_turn_aborts_it() -> None:
    def reject_second(effect: Any) -> HookDecision:
        if effect.step == 1:
            return HookDecision(effect.messages)
        return HookDecision((), rejected=True, reason="budget")

    events, _ = run_turn(Attempt(tool_reply(("c1", "echo", "{}"))), hook=reject_second)
    assert end_reason(events) == {"kind": "aborted", "reason": {"kind": "hook",
                                                                "reason": "budget"}}


def test_hook_rewrites_the_claimed_messages() -> None:
    def rewrite(effect: Any) -> HookDecision:
        return HookDecision(tuple({**m, "content": [{"type": "text", "text": "rewritten"}]}
                                  for m in effect.messages))

    _, harness = run_turn(Attempt(text_reply("a")), hook=rewrite)
    assert harness.requests[0].messages[0]["content"] == [{"type": "text", "text": "rewritten"}]


def test_a_request_that_differs_from_the_log_is_refused() -> None:
    machine = new_machine()
    harness = Harness(machine, iter(()))
    machine.submit(follow_up("hello"), 1)
    effect = machine.next_effect(harness.now())
    while not isinstance(effect, CallModel):
        harness._perform(effect)
        effect = machine.next_effect(harness.now())
    request = effect.request
    machine.check_request(request)  # the request the machine built passes
    bad_message = ModelRequest(request.provider, request.model,
                               ({"role": "user", "content": "injected"}, *request.messages),
                               request.system, request.tools)
    bad_model = ModelRequest(request.provider, "other", request.messages, request.system)
    for bad in (bad_message, bad_model):
        with pytest.raises(InvariantViolation, match="differs from the log"):
            machine.check_request(bad)


def test_crash_repair_then_resume_matches_the_fixture() -> None:
    recorded = list(fixture_events("tool-outcome-unknown"))
    crashed = recorded[:5]  # up to the recorded tool/call, before any closer
    log = SessionLog.from_events("s1", crashed)
    machine = TurnMachine(log, new_id=counter_ids(), config=CONFIG)
    resumed = recorded[9]  # the follow-up the fixture's next turn claims
    inserted = resumed.data["inserted"][0]
    harness = Harness(machine, iter([Attempt([e.data["chunk"] for e in recorded
                                              if e.type == "assistant/chunk"])]))
    machine.submit(FollowUp("s1", "resume-1", tuple(inserted["content"])), 0)
    produced = machine.take_events() + harness.run()
    expected = [e for e in recorded[5:] if e.type not in PLUGIN_ONLY | {"session/end-seed"}]
    got, want = normalized(produced), normalized(expected)
    for item in (*got, *want):  # the fixture's messages carry a placeholder id
        item["data"].pop("id", None)
        if item["type"] == "agent/inbox/spliced":
            for message in item["data"]["inserted"]:
                message.pop("id", None)
    assert got == want
    assert produced[0].seq == 5 and produced[0].data["error"]["code"] == "TOOL_OUTCOME_UNKNOWN"


def test_validation_refuses_to_drive_out_of_order() -> None:
    machine = new_machine()
    with pytest.raises(TurnError, match="hooks_done called in phase IDLE"):
        machine.hooks_done(HookDecision(()), 1)


def test_no_configuration_ends_the_turn_with_an_error_but_keeps_the_message() -> None:
    machine = new_machine(config=None)
    events, harness = run_turn(machine=machine)
    assert end_reason(events)["error"]["code"] == "NO_MODEL_CONFIGURED"
    assert "user/message" in types(events) and harness.requests == []


def test_a_redelivered_command_is_not_queued_twice() -> None:
    machine = new_machine()
    assert machine.submit(follow_up("x", "m1"), 1)
    assert not machine.submit(follow_up("x", "m1"), 2)
    rebuilt = new_machine(SessionLog.from_events("s1", machine.take_events()))
    assert not rebuilt.submit(follow_up("x", "m1"), 3)
    assert len(rebuilt.inbox.next_turn) == 1  # and the queued item survived the rebuild


def test_replay_state_of_the_finish_is_kept_in_the_message_source() -> None:
    chunks = [*text_reply("a")[:-1],
              {"type": "finish", "reason": {"kind": "stop"}, "replayState": {"k": [1]}}]
    events, _ = run_turn(Attempt(chunks))
    message = next(e for e in events if e.type == "assistant/message")
    assert message.data["message"]["source"] == {
        "kind": "model", "provider": "deepseek-official", "model": "deepseek-v4-flash",
        "replayState": {"k": [1]}}


def test_cancel_after_a_whole_tool_call_streamed_answers_it() -> None:
    chunks = tool_reply(("c1", "echo", "{}"))
    events, _ = run_turn(Attempt(chunks, cancel_after=3))  # after its block-end
    message = next(e for e in events if e.type == "assistant/message")
    assert message.data["interrupted"] is True
    assert [b["type"] for b in message.data["message"]["content"]] == ["tool-call"]
    result = next(e for e in events if e.type == "tool/result")
    assert result.data["error"]["code"] == "TOOL_CANCELED"
    log = SessionLog.from_events("s1", events)
    assert log.turn.open_calls == () and log.messages()[-1]["role"] == "user"


def test_first_configure_needs_provider_and_model() -> None:
    machine = new_machine(config=None)
    with pytest.raises(ConfigError, match="provider and a model"):
        machine.submit(Configure("s1", "c1", model="m"), 1)
    assert machine.take_events() == [] and machine.config is None


def test_inbox_rebuilt_from_the_agent_instructions_fixture_is_empty() -> None:
    machine = new_machine(SessionLog.from_events("s1", fixture_events("agent-instructions")))
    assert machine.inbox.next_turn == [] and machine.inbox.next_step == []
    assert machine.turn == 1 and not machine.busy
    # a redelivery of a message that already went through the inbox is recognised
    assert not machine.submit(FollowUp("s1", "81078e7a-6837-45c2-a6b4-a5a3dfce0d4a", (
        {"type": "text", "text": "again"},)), 1)


def test_a_configure_mid_stream_applies_to_the_next_request_only() -> None:
    machine = new_machine()
    harness = Harness(machine, iter([Attempt(tool_reply(("c1", "echo", "{}"))),
                                     Attempt(text_reply("b"))]))
    machine.submit(follow_up("hi"), 1)
    effect = machine.next_effect(harness.now())
    while not isinstance(effect, CallModel):
        harness._perform(effect)
        effect = machine.next_effect(harness.now())
    machine.submit(Configure("s1", "c1", model="next-model"), harness.now())
    harness._perform(effect)
    events = machine.take_events() + harness.run()
    messages = [e for e in events if e.type == "assistant/message"]
    assert [m.data["message"]["source"]["model"] for m in messages] == [
        "deepseek-v4-flash", "next-model"]
    assert [r.model for r in harness.requests] == ["deepseek-v4-flash", "next-model"]
