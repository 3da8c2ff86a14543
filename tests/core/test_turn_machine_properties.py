"""Properties of the turn machine over generated scenarios and generated logs.

Whatever commands arrive and whatever the provider does (text, tool calls, retriable and fatal
errors, max-tokens, a cancel mid-stream or during tools), the machine ends idle with a log
that validates in strict mode, every turn closed, every tool call answered, nothing woken left
in the inbox, and every request it made equal to the derived messages of the log at the time.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import valid_logs
from test_turn_machine_harness import Attempt, Harness, new_machine, text_reply, tool_reply

from pipeline.core.errors import ProviderError
from pipeline.core.events import Event
from pipeline.core.inbox import Cancel, Configure, FollowUp, InboxCommand, Inject, Steer
from pipeline.core.log import SessionLog
from pipeline.core.turn_config import CONFIG_TYPE, config_disagreements
from pipeline.core.turn_effects import HookDecision, RunTools, SessionConfig

TEXT = ({"type": "text", "text": "x"},)


@st.composite
def attempts(draw: st.DrawFn) -> Attempt:
    kind = draw(st.sampled_from(["text", "tools", "retriable", "fatal", "max", "cancel"]))
    if kind == "text":
        return Attempt(text_reply(draw(st.text(max_size=5))))
    if kind == "tools":
        count = draw(st.integers(1, 3))
        return Attempt(tool_reply(*[(f"c{draw(st.integers(0, 10**6))}-{i}", "echo", "{}")
                                    for i in range(count)]))
    if kind == "retriable":
        cut = draw(st.integers(0, 3))
        return Attempt(text_reply("abc")[:cut], error=ProviderError("x", code="SERVER"))
    if kind == "fatal":
        return Attempt([], error=ProviderError("no", code="AUTH", status=401))
    if kind == "max":
        return Attempt([*text_reply("ab")[:-1],
                        {"type": "finish", "reason": {"kind": "max-tokens"}}])
    chunks = text_reply("abc")
    return Attempt(chunks, cancel_after=draw(st.integers(0, len(chunks) - 1)))


@st.composite
def commands(draw: st.DrawFn) -> list[InboxCommand]:
    out: list[InboxCommand] = []
    for n in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["followup", "followup", "steer", "inject", "cancel",
                                     "configure"]))
        if kind == "followup":
            out.append(FollowUp("s1", f"f{n}", TEXT))
        elif kind == "steer":
            out.append(Steer("s1", f"s{n}", TEXT))
        elif kind == "inject":
            out.append(Inject("s1", f"i{n}", TEXT))
        elif kind == "cancel":
            out.append(Cancel("s1", f"x{n}", keep_queue=draw(st.booleans())))
        else:
            out.append(Configure("s1", f"c{n}", max_tokens=draw(st.integers(1, 9)),
                                 model=draw(st.sampled_from([None, "m-a", "m-b"])),
                                 system=draw(st.sampled_from([None, "sys"]))))
    return out


def check_closed_and_valid(events: list[Event] | tuple[Event, ...]) -> SessionLog:
    log = SessionLog.from_events("s1", events, mode="strict")
    assert not log.turn.in_turn and log.turn.open_calls == ()
    starts = [e.data["turn"] for e in events if e.type == "turn/start"]
    ends = [e.data["turn"] for e in events if e.type == "turn/end"]
    assert starts == ends[len(ends) - len(starts):]
    return log


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(commands(), st.lists(attempts(), min_size=30, max_size=30), st.booleans(),
       st.integers(0, 5))
def test_any_scenario_ends_idle_with_a_valid_closed_log(
        cmds: list[InboxCommand], script: list[Attempt], reject_first: bool,
        cancel_at_tools: int) -> None:
    machine = new_machine()
    tool_rounds = 0

    def on_tools(harness: Harness, effect: RunTools) -> bool:
        nonlocal tool_rounds
        tool_rounds += 1
        if tool_rounds == cancel_at_tools:  # cancel while the first call runs
            first = effect.calls[0]
            machine.tool_started(first.call_id, harness.now())
            machine.submit(Cancel("s1", f"tc{tool_rounds}"), harness.now())
            machine.tool_finished(first.call_id, harness.outcome(first.call_id), harness.now())
            return False
        return True

    def hook(effect: Any) -> HookDecision:
        blocked = reject_first and effect.turn == 1
        return HookDecision((), rejected=True) if blocked else HookDecision(effect.messages)

    harness = Harness(machine, iter(script), hook=hook, on_tools=on_tools)
    for command in cmds:
        machine.submit(command, harness.now())
    harness.run()
    check_closed_and_valid(machine.log.events)  # (each request was checked when made)
    assert not machine.inbox.wakes
    # the log alone gives the configuration back, and no header contradicts a configure
    assert config_disagreements(machine.log.events) == []
    other = SessionConfig("other-provider", "other-model")
    rebuilt = new_machine(SessionLog.from_events("s1", machine.log.events), config=other)
    logged = any(e.type in ("request/header", CONFIG_TYPE) for e in machine.log.events)
    assert rebuilt.config == (machine.config if logged else other)  # else: only a default


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_logs())
def test_any_log_is_repaired_then_runs_a_valid_turn(events: list[Event]) -> None:
    log = SessionLog.from_events("s1", events, mode="strict")
    machine = new_machine(log)
    harness = Harness(machine, iter([Attempt(tool_reply(("new-call", "echo", "{}"))),
                                     Attempt(text_reply("ok"))]))
    machine.submit(FollowUp("s1", "resume-follow-up", TEXT), harness.now())
    harness.run()
    check_closed_and_valid(machine.log.events)
    new = machine.log.events[len(events):]
    assert [e.type for e in new].count("turn/start") == 1
    assert new[-1].type == "turn/end" and new[-1].data["reason"] == {"kind": "completed"}
