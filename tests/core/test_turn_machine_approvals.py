"""Durable approval of tool calls in the turn machine, as plain data (no I/O, no broker)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from test_turn_machine_harness import CONFIG, counter_ids, text_reply, tool_reply

from pipeline.core.approvals import ApprovalRules, waiting_approval
from pipeline.core.events import Event
from pipeline.core.genai_spans import SessionTraces, build_spans
from pipeline.core.inbox import Approve, Cancel, Configure, Deny, FollowUp, Steer
from pipeline.core.log import SessionLog
from pipeline.core.repair import repair_closers
from pipeline.core.turn_effects import (
    AwaitApproval,
    CallModel,
    HookDecision,
    Idle,
    RunPreStepHooks,
    RunTools,
    StepBoundary,
    ToolOutcome,
)
from pipeline.core.turn_machine import TurnMachine

GATED = ApprovalRules(require=("bash", "mcp__*"), timeout_ms=60_000)


class Driven:
    """Drives a machine as the runner does: a held-back call stops the round."""

    def __init__(self, machine: TurnMachine, replies: Sequence[list[dict[str, Any]]]) -> None:
        self.machine = machine
        self.replies: Iterator[list[dict[str, Any]]] = iter(replies)
        self.time = 1_000
        self.ran: list[str] = []
        self.events: list[Event] = []

    def now(self) -> int:
        self.time += 1
        return self.time

    def run(self) -> Idle | AwaitApproval:
        m = self.machine
        while True:
            effect = m.next_effect(self.now())
            if isinstance(effect, Idle | AwaitApproval):
                self.events += m.take_events()
                return effect
            if isinstance(effect, RunPreStepHooks):
                m.hooks_done(HookDecision(effect.messages), self.now())
            elif isinstance(effect, CallModel):
                m.check_request(effect.request)
                for chunk in next(self.replies):
                    m.chunk(chunk, self.now())
                m.stream_ended(self.now())
            elif isinstance(effect, RunTools):
                for call in effect.calls:
                    if not m.tool_started(call.call_id, self.now()):
                        break
                    self.ran.append(call.call_id)
                    m.tool_finished(call.call_id, ToolOutcome.text(f"ran {call.call_id}"),
                                    self.now())
            else:
                assert isinstance(effect, StepBoundary)

    def submit(self, command: Any) -> bool:
        return self.machine.submit(command, self.now())


def machine(log: SessionLog | None = None, rules: ApprovalRules = GATED) -> TurnMachine:
    return TurnMachine(log or SessionLog("s1"), new_id=counter_ids(), config=CONFIG,
                       approvals=rules)


def started_waiting(*calls: tuple[str, str, str], rules: ApprovalRules = GATED
                    ) -> tuple[Driven, AwaitApproval]:
    driven = Driven(machine(rules=rules), [tool_reply(*calls), text_reply("done")])
    driven.submit(FollowUp("s1", "m1", ({"type": "text", "text": "go"},)))
    effect = driven.run()
    assert isinstance(effect, AwaitApproval)
    return driven, effect


def of_type(events: Sequence[Event], type_: str) -> list[Event]:
    return [e for e in events if e.type == type_]


def tool_results(driven: Driven) -> dict[str, Any]:
    return {e.data["message"]["source"]["callId"]: e.data for e in of_type(driven.events,
                                                                           "tool/result")}


def test_a_gated_call_is_recorded_then_waits_with_dshs_ask() -> None:
    driven, effect = started_waiting(("c1", "echo", "{}"), ("c2", "bash", '{"command": "ls"}'),
                                     ("c3", "echo", "{}"))
    assert effect == AwaitApproval("c2", driven.events[-1].time + 60_000)
    tail = [e.type for e in driven.events[-3:]]
    assert tail == ["tool/result", "tool/call", "approval/asked"]  # c1 answered, c2 asked
    asked = driven.events[-1].data
    assert asked == {"id": asked["id"], "toolName": "bash", "callId": "c2",
                     "reason": 'tool "bash" matches the approval rule "bash"'}
    assert driven.ran == ["c1"] and driven.machine.busy
    assert driven.machine.waiting_for == "c2"


def test_approve_runs_the_call_once_and_the_turn_goes_on() -> None:
    driven, _ = started_waiting(("c1", "bash", "{}"), ("c2", "echo", "{}"))
    assert driven.submit(Approve("s1", "a1", "c1", reason="looks safe",
                                 source={"kind": "user", "name": "alice"}))
    assert isinstance(driven.run(), Idle)
    assert driven.ran == ["c1", "c2"]
    audit, decided = of_type(driven.events, "dsh-pipeline/approval")[0], \
        of_type(driven.events, "approval/decided")[0]
    asked = of_type(driven.events, "approval/asked")[0]
    assert decided.data == {"id": asked.data["id"], "outcome": "allowed-once"}
    assert audit.ignorable and audit.data == {
        "id": asked.data["id"], "callId": "c1", "outcome": "allowed-once",
        "decision": "approve", "messageId": "a1", "by": {"kind": "user", "name": "alice"},
        "reason": "looks safe"}
    assert of_type(driven.events, "tool/call")[0].data["callId"] == "c1"
    assert len(of_type(driven.events, "tool/call")) == 2  # c1 recorded once, not again
    assert driven.events[-1].data["reason"] == {"kind": "completed"}
    assert not driven.submit(Approve("s1", "a1", "c1"))  # the same message: a duplicate


def test_deny_gives_the_model_an_error_result_with_the_reason() -> None:
    driven, _ = started_waiting(("c1", "bash", "{}"))
    assert driven.submit(Deny("s1", "d1", "c1", reason="not on prod"))
    driven.run()
    assert driven.ran == []
    result = tool_results(driven)["c1"]
    block = result["message"]["content"][0]
    assert block["isError"] and block["content"][0]["text"] == \
        'Error: the user rejected tool "bash": not on prod'
    assert result["error"] == {"name": "ToolApprovalError", "code": "APPROVAL_REJECTED"}
    assert of_type(driven.events, "approval/decided")[0].data["outcome"] == "rejected"


def test_a_second_decision_is_refused_and_says_who_won() -> None:
    driven, _ = started_waiting(("c1", "bash", "{}"))
    assert driven.submit(Approve("s1", "a1", "c1", source={"kind": "user", "name": "alice"}))
    assert driven.submit(Deny("s1", "d1", "c1", source={"kind": "user", "name": "bob"}))
    driven.run()
    [refused] = of_type(driven.events, "dsh-pipeline/approval-refused")
    assert refused.ignorable and refused.data == {
        "messageId": "d1", "callId": "c1", "decision": "deny",
        "refusal": "refused: tool call 'c1' was already approved by user alice (message a1)"}
    assert driven.ran == ["c1"] and len(of_type(driven.events, "approval/decided")) == 1
    assert not driven.submit(Deny("s1", "d1", "c1"))  # its redelivery: a duplicate


def test_timeout_denies_at_the_deadline_only() -> None:
    driven, effect = started_waiting(("c1", "bash", "{}"))
    assert effect.deadline is not None
    assert not driven.machine.expire_approval(effect.deadline - 1)
    assert driven.machine.expire_approval(effect.deadline)
    driven.run()
    assert of_type(driven.events, "approval/decided")[0].data["outcome"] == "unavailable"
    result = tool_results(driven)["c1"]
    assert result["error"]["code"] == "APPROVAL_TIMEOUT"
    assert "timed out after 60 s" in result["message"]["content"][0]["content"][0]["text"]


def test_cancel_while_waiting_resolves_the_ask_cancelled_and_aborts() -> None:
    driven, _ = started_waiting(("c1", "bash", "{}"), ("c2", "echo", "{}"))
    driven.submit(Cancel("s1", "x1"))
    assert isinstance(driven.run(), Idle)
    assert of_type(driven.events, "approval/decided")[0].data["outcome"] == "cancelled"
    results = tool_results(driven)
    assert results["c1"]["error"]["code"] == "TOOL_CANCELED"
    assert results["c2"]["error"]["code"] == "TOOL_CANCELED"
    assert driven.events[-1].data["reason"] == {"kind": "aborted", "reason": {"kind": "user"}}
    assert driven.ran == []


def test_steer_waits_for_the_decision_then_enters_the_next_step() -> None:
    driven, _ = started_waiting(("c1", "bash", "{}"))
    driven.submit(Steer("s1", "st1", ({"type": "text", "text": "also this"},)))
    assert isinstance(driven.run(), AwaitApproval)  # queued, the step still waits
    driven.submit(Approve("s1", "a1", "c1"))
    driven.run()
    messages = [e.data["id"] for e in of_type(driven.events, "user/message")]
    assert messages == ["m1", "st1"]
    result_seq = of_type(driven.events, "tool/result")[0].seq
    steer_seq = of_type(driven.events, "user/message")[1].seq
    assert result_seq < steer_seq


def test_follow_up_waits_for_the_next_turn() -> None:
    driven, _ = started_waiting(("c1", "bash", "{}"))
    driven.replies = iter([text_reply("done"), text_reply("second")])
    driven.submit(FollowUp("s1", "f1", ({"type": "text", "text": "next"},)))
    assert isinstance(driven.run(), AwaitApproval)
    driven.submit(Deny("s1", "d1", "c1"))
    driven.run()
    starts = of_type(driven.events, "turn/start")
    assert [e.data["turn"] for e in starts] == [1, 2]
    assert of_type(driven.events, "tool/result")[0].seq < starts[1].seq


def test_a_rebuilt_log_keeps_waiting_and_is_not_repaired() -> None:
    driven, _ = started_waiting(("c1", "echo", "{}"), ("c2", "bash", "{}"),
                                ("c3", "echo", "{}"))
    log = SessionLog("s1")
    log.extend(driven.machine.log.events)
    assert repair_closers(log) == []
    assert waiting_approval(log.events) is not None
    rebuilt = Driven(machine(log), [text_reply("done")])
    assert not rebuilt.machine.recover(rebuilt.now())
    assert isinstance(rebuilt.run(), AwaitApproval) and rebuilt.events == []
    rebuilt.machine.abort("disposed")  # a driver giving the session up leaves it waiting
    assert isinstance(rebuilt.run(), AwaitApproval)
    rebuilt.submit(Approve("s1", "a1", "c2"))
    rebuilt.run()
    assert rebuilt.ran == ["c2", "c3"]
    assert [e.type for e in rebuilt.events].count("tool/call") == 1  # c3 only: c2 was logged


def test_an_approved_call_without_result_is_repaired_as_unknown_not_rerun() -> None:
    driven, _ = started_waiting(("c1", "bash", "{}"))
    driven.submit(Approve("s1", "a1", "c1"))
    log = SessionLog("s1")
    log.extend(driven.machine.log.events)  # the approval logged, no result yet
    closers = repair_closers(log)
    assert closers[0].data["error"]["code"] == "TOOL_OUTCOME_UNKNOWN"


def test_policy_never_rejects_without_waiting() -> None:
    driven = Driven(machine(), [tool_reply(("c1", "bash", "{}")), text_reply("ok")])
    driven.submit(Configure("s1", "cfg", approval_policy="never"))
    driven.submit(Configure("s1", "cfg2", approval_policy="never"))  # no switch: not logged
    driven.submit(FollowUp("s1", "m1", ({"type": "text", "text": "go"},)))
    assert isinstance(driven.run(), Idle)
    assert [e.data for e in of_type(driven.events, "approval/policy")] == [{"policy": "never"}]
    assert of_type(driven.events, "approval/decided")[0].data["outcome"] == "rejected"
    assert tool_results(driven)["c1"]["error"]["code"] == "APPROVAL_REJECTED"


def test_session_patterns_add_to_the_drivers_and_survive_a_rebuild() -> None:
    driven = Driven(machine(rules=ApprovalRules()), [tool_reply(("c1", "echo", "{}"))])
    driven.submit(Configure("s1", "cfg", require_approval=("ec*",)))
    driven.submit(FollowUp("s1", "m1", ({"type": "text", "text": "go"},)))
    assert isinstance(driven.run(), AwaitApproval)
    rebuilt = machine(SessionLog("s1"), rules=ApprovalRules())
    rebuilt.log.extend(driven.machine.log.events)
    assert TurnMachine(rebuilt.log, new_id=counter_ids(), config=CONFIG).needs_approval("echo")


def test_an_approve_with_nothing_waiting_is_refused() -> None:
    driven = Driven(machine(), [])
    assert driven.submit(Approve("s1", "a9", "nope"))
    driven.run()
    [refused] = of_type(driven.events, "dsh-pipeline/approval-refused")
    assert refused.data["refusal"] == "refused: tool call 'nope' is not waiting for approval"


def test_otel_records_the_wait_as_span_events_of_the_tool_span() -> None:
    driven, _ = started_waiting(("c1", "bash", "{}"))
    driven.time += 5_000  # the person takes 5 s
    driven.submit(Approve("s1", "a1", "c1"))
    driven.run()
    traces = SessionTraces("s1")
    ended = [t for i, e in enumerate(driven.machine.log.events)
             if (t := traces.add(e, i)) is not None]
    [tool_span] = [s for s in build_spans(ended[0]) if s.name == "execute_tool bash"]
    asked, decided = tool_span.events
    assert asked.name == "dsh.approval.asked" and decided.name == "dsh.approval.decided"
    assert asked.attributes["dsh.approval.reason"] == \
        'tool "bash" matches the approval rule "bash"'
    assert decided.attributes["dsh.approval.outcome"] == "allowed-once"
    assert decided.attributes["dsh.approval.wait_ms"] >= 5_000
