"""Session checkpoints: folding in pieces equals folding whole, and a restored bounded log plus
History continue exactly like a log holding every event (plain data, no broker).

The logs: every dsh fixture, and logs the in-memory :class:`Driver` writes with tool calls,
approvals (approved, denied, refused, cancelled, one left waiting), a configure and queued
inbox items; hypothesis adds random valid logs with replaces.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_paths import SHARED_DIR
from strategies import valid_logs

from pipeline.adapters.llm.scripted import ScriptedProvider, ScriptedReply, ScriptedToolCall
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.approvals import ApprovalRules
from pipeline.core.checkpoint import VERSION, SessionCheckpoint
from pipeline.core.errors import CodecError, EventError, SequenceError, TurnError
from pipeline.core.events import APPEND, Event, JsonValue, SurfaceOp
from pipeline.core.inbox import Approve, Cancel, Configure, Deny, FollowUp, Inject
from pipeline.core.log import Mode, SessionLog
from pipeline.core.model import ModelRequest
from pipeline.core.surface import SurfaceFold
from pipeline.core.turn_effects import CallModel, HookDecision, RunPreStepHooks, SessionConfig
from pipeline.core.turn_history import History, scan_history
from pipeline.core.turn_machine import TurnMachine
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.tools import ToolRegistry, ToolSpec, builtin_registry

FIXTURES = sorted((SHARED_DIR / "fixtures").rglob("*.jsonl"))
CONFIG = SessionConfig("scripted", "scripted-1")
RULES = ApprovalRules(require=("danger",), timeout_ms=60_000)
NOW = 1_900_000_000_000


# -- the logs -------------------------------------------------------------------------------

def mode_of(events: Sequence[Event]) -> Mode:
    """strict when a strict log takes them (the seed example needs ingest)."""
    try:
        SessionLog.from_events("s", events, mode="strict")
    except EventError:
        return "ingest"
    return "strict"


@functools.cache
def fixture_log(path: Path) -> tuple[tuple[Event, ...], Mode]:
    events = tuple(read_session_file(path).events)
    return events, mode_of(events)


def gated_calls(request: ModelRequest, attempt: int) -> ScriptedReply:
    """Echo, the gated ``danger``, echo after a person's message; an answer after results."""
    last = request.messages[-1] if request.messages else {}
    if isinstance(last, dict) and last.get("source", {}).get("kind") == "tool":
        return ScriptedReply(text="done")
    n = len(request.messages)
    return ScriptedReply(tool_calls=(ScriptedToolCall("echo", '{"text": "a"}', f"e{n}a"),
                                     ScriptedToolCall("danger", "{}", f"d{n}"),
                                     ScriptedToolCall("echo", '{"text": "b"}', f"e{n}b")))


def danger_registry() -> ToolRegistry:
    async def danger(args: dict[str, Any]) -> str:
        return "did it"

    tools = builtin_registry()
    tools.register(ToolSpec("danger", "needs a person", {"type": "object"}, danger,
                            parallel_safe=True))
    return tools


async def _drive(session: str) -> list[Event]:
    """Approved, denied, refused, cancelled while waiting, and left waiting at the end."""
    provider = ScriptedProvider(gated_calls)
    ids = (f"id-{n}" for n in itertools.count())
    drv = Driver(provider_factory=lambda _p, _m: provider, tools=danger_registry(),
                 config=CONFIG, approvals=RULES, new_id=lambda: next(ids),
                 clock=itertools.count(NOW, 7).__next__)

    async def step(*commands: Any) -> None:
        drv.submit_all(commands)
        await drv.drain()

    def waiting() -> str:
        call_id = drv.runners[session].machine.waiting_for
        assert call_id is not None
        return call_id

    def say(message_id: str, kind: type[FollowUp] | type[Inject] = FollowUp) -> Any:
        return kind(session, message_id, ({"type": "text", "text": message_id},))

    await step(say("m1"))
    first = waiting()
    await step(Approve(session, "a1", first))
    await step(Approve(session, "a2", first))  # too late: refused, logged
    await step(Configure(session, "c1", model="scripted-2", require_approval=("other",)))
    await step(say("m2"))
    await step(Deny(session, "d1", waiting(), reason="no"))
    await step(say("i1", Inject), say("m3"))
    waiting()
    await step(Cancel(session, "x1"))
    await step(say("m4"))
    waiting()  # the log ends with a turn waiting for approval
    assert isinstance(drv.sink, MemorySink)
    return drv.sink.events[session]


@functools.cache
def driver_log() -> tuple[Event, ...]:
    events = tuple(asyncio.run(_drive("s1")))
    SessionLog.from_events("s1", events, mode="strict")
    return events


LOGS = [path.stem for path in FIXTURES] + ["driver"]


def log_named(name: str) -> tuple[tuple[Event, ...], Mode]:
    if name == "driver":
        return driver_log(), "strict"
    return fixture_log(next(path for path in FIXTURES if path.stem == name))


# -- helpers --------------------------------------------------------------------------------

def folded(events: Sequence[Event], session: str = "s1") -> SessionCheckpoint:
    checkpoint = SessionCheckpoint(session)
    checkpoint.advance(events)
    return checkpoint


def through_json(checkpoint: SessionCheckpoint) -> SessionCheckpoint:
    return SessionCheckpoint.from_json(json.loads(json.dumps(checkpoint.to_json())))


def open_turn_of(events: Sequence[Event]) -> list[Event]:
    """The open turn's events, from its turn/start (none when no turn is open)."""
    log = SessionLog("s", mode="ingest")
    log.extend(events)
    if not log.turn.in_turn:
        return []
    start = max(i for i, e in enumerate(events) if e.type == "turn/start")
    return list(events[start:])


def machine(log: SessionLog, history: History | None = None) -> TurnMachine:
    ids = (f"new-{n}" for n in itertools.count())
    return TurnMachine(log, new_id=lambda: next(ids), config=CONFIG, approvals=RULES,
                       history=history)


def machine_pair(events: Sequence[Event], mode: Mode, k: int
                 ) -> tuple[TurnMachine, TurnMachine]:
    """A machine over the full log of ``events[:k]`` and one over the checkpoint at k."""
    full = machine(SessionLog.from_events("s1", events[:k], mode=mode))
    log, history = folded(events[:k]).restore(mode=mode)
    return full, machine(log, history)


# -- folding in pieces ----------------------------------------------------------------------

@pytest.mark.parametrize("name", LOGS)
def test_folding_in_pieces_through_json_equals_the_straight_fold(name: str) -> None:
    events, _ = log_named(name)
    whole = folded(events).to_json()
    assert json.loads(json.dumps(whole)) == whole
    for k in range(len(events) + 1):
        checkpoint = through_json(folded(events[:k]))
        checkpoint.advance(events[k:])
        assert checkpoint.to_json() == whole, f"split at {k}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_logs_fold_alike_in_any_pieces(data: st.DataObject) -> None:
    events = data.draw(valid_logs())
    cuts = sorted(data.draw(st.lists(st.integers(0, len(events)), max_size=3)))
    checkpoint = SessionCheckpoint("s1")
    start = 0
    for cut in cuts:
        checkpoint.advance(events[start:cut])
        checkpoint, start = through_json(checkpoint), cut
    checkpoint.advance(events[start:])
    assert checkpoint.to_json() == folded(events).to_json()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_logs_restore_and_go_on_like_the_whole_log(data: st.DataObject) -> None:
    events = data.draw(valid_logs())
    k = data.draw(st.integers(0, len(events)))
    log, history = through_json(folded(events[:k])).restore()
    log.extend(events[k:])
    full = SessionLog.from_events("s1", events)
    assert (log.messages(), log.turn, log.next_seq) == (full.messages(), full.turn,
                                                        full.next_seq)
    assert list(log.events) == open_turn_of(events)
    assert history.to_json() == scan_history(events[:k]).to_json()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_logs_repair_alike_when_restored(data: st.DataObject) -> None:
    events = data.draw(valid_logs())
    k = data.draw(st.integers(0, len(events)))
    full, restored = machine_pair(events, "strict", k)
    assert restored.recover(NOW) == full.recover(NOW)
    assert restored.take_events() == full.take_events()
    assert restored.waiting_for == full.waiting_for


def test_a_question_asked_before_the_open_turn_is_seen_through_the_history() -> None:
    """The one approval state that outlives a turn boundary: an ask logged between turns and
    never decided (not something this driver writes). The bounded log's events do not hold
    it; the History does, and the machine reads the History, so both machines wait."""
    call = {"type": "tool-call", "id": "c1", "name": "danger", "arguments": "{}"}
    events = [
        Event("turn/start", 0, 1, {"turn": 1}),
        Event("turn/end", 1, 2, {"turn": 1, "reason": {"kind": "completed"}}),
        Event("approval/asked", 2, 3, {"id": "q1", "toolName": "danger", "callId": "c1",
                                        "reason": "r"}),
        Event("turn/start", 3, 4, {"turn": 2}),
        Event("step/start", 4, 5, {"turn": 2, "step": 1}),
        Event("assistant/message", 5, 6, {"turn": 2, "step": 1, "message": {
            "id": "a1", "role": "assistant", "source": {"kind": "model"}, "content": [call]}},
            APPEND, ()),
        Event("tool/call", 6, 7, {"turn": 2, "step": 1, "callId": "c1", "name": "danger",
                                  "arguments": "{}"}),
    ]
    full, restored = machine_pair(events, "strict", len(events))
    assert restored.recover(NOW) is full.recover(NOW) is False
    assert restored.waiting_for == full.waiting_for == "c1"
    assert restored.take_events() == full.take_events() == []


# -- restore --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", LOGS)
def test_a_restored_log_goes_on_exactly_like_the_whole_log(name: str) -> None:
    events, mode = log_named(name)
    full = SessionLog.from_events("s1", events, mode=mode)
    for k in range(len(events) + 1):
        checkpoint = through_json(folded(events[:k]))
        log, history = checkpoint.restore(mode=mode)
        assert log.bounded and log.next_seq == k
        assert list(log.events) == open_turn_of(events[:k])
        assert history.to_json() == scan_history(events[:k]).to_json(), f"split at {k}"
        log.extend(events[k:])
        assert log.messages() == full.messages(), f"split at {k}"
        assert (log.turn, log.next_seq) == (full.turn, full.next_seq), f"split at {k}"
        assert list(log.events) == open_turn_of(events)


@pytest.mark.parametrize("name", LOGS)
def test_repair_at_every_open_split_matches_the_whole_log(name: str) -> None:
    events, mode = log_named(name)
    opened = 0
    for k in range(len(events) + 1):
        full, restored = machine_pair(events, mode, k)
        if not full.log.turn.in_turn:
            continue
        opened += 1
        assert restored.recover(NOW) == full.recover(NOW), f"split at {k}"
        assert restored.take_events() == full.take_events(), f"split at {k}"
        assert (restored.waiting_for, restored.approval_deadline, restored.phase) == (
            full.waiting_for, full.approval_deadline, full.phase)
        assert restored.next_effect(NOW + 1) == full.next_effect(NOW + 1)
        assert restored.take_events() == full.take_events()
        assert restored.log.messages() == full.log.messages()
    assert opened  # every log holds splits inside a turn


@pytest.mark.parametrize("name", LOGS)
def test_a_follow_up_at_every_idle_split_runs_like_on_the_whole_log(name: str) -> None:
    events, mode = log_named(name)
    for k in range(len(events) + 1):
        full, restored = machine_pair(events, mode, k)
        if full.log.turn.in_turn:
            continue
        assert restored.turn == full.turn and restored.busy == full.busy
        for m in (full, restored):
            m.submit(FollowUp("s1", f"probe-{k}", ({"type": "text", "text": "again"},)), NOW)
        effects = [m.next_effect(NOW) for m in (full, restored)]
        assert effects[0] == effects[1] and isinstance(effects[0], RunPreStepHooks)
        for m in (full, restored):
            m.hooks_done(HookDecision(effects[0].messages), NOW)
        calls = [m.next_effect(NOW) for m in (full, restored)]
        assert calls[0] == calls[1] and isinstance(calls[0], CallModel), f"split at {k}"
        assert restored.take_events() == full.take_events(), f"split at {k}"


def test_the_driver_log_ends_waiting_and_the_restored_machine_waits_too() -> None:
    events = driver_log()
    checkpoint = through_json(folded(events))
    asked = [e for e in events if e.type == "approval/asked"][-1]
    assert checkpoint.busy and checkpoint.approval_asked_at == asked.time
    full, restored = machine_pair(events, "strict", len(events))
    assert restored.recover(NOW) is full.recover(NOW) is False
    assert restored.waiting_for == full.waiting_for == asked.data["callId"]
    assert restored.approval_deadline == asked.time + 60_000
    assert restored.next_effect(NOW) == full.next_effect(NOW)
    kinds = {e.data.get("decision") for e in events if e.type == "dsh-pipeline/approval"}
    assert kinds == {"approve", "deny", "cancel"}  # the log covers every decision kind
    assert any(e.type == "dsh-pipeline/approval-refused" for e in events)


def test_restore_shares_no_state_with_the_checkpoint() -> None:
    events = driver_log()
    k = next(i for i, e in enumerate(events) if e.type == "approval/asked") + 1
    checkpoint = folded(events[:k])
    before = json.dumps(checkpoint.to_json())
    log, history = checkpoint.restore()
    log.extend(events[k:])
    history.inbox.insert(FollowUp("s1", "extra", ({"type": "text", "text": "x"},)))
    history.message_ids.add("extra")
    history.approvals.waiting = None
    history.approvals.verdicts["x"] = "y"
    assert history.header is not None
    history.header["system"] = "edited"
    assert json.dumps(checkpoint.to_json()) == before
    again, _ = checkpoint.restore()
    assert again.next_seq == k and again.messages() != log.messages()


# -- bounded logs ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", LOGS)
def test_a_bounded_log_holds_only_the_open_turn(name: str) -> None:
    events, mode = log_named(name)
    bounded = SessionLog("s1", mode=mode, bounded=True)
    for k, event in enumerate(events, start=1):
        bounded.append(event)
        assert list(bounded.events) == open_turn_of(events[:k])
        assert bounded.next_seq == k
        if event.type == "turn/end":
            assert len(bounded.events) == 0
    full = SessionLog.from_events("s1", events, mode=mode)
    assert (bounded.messages(), bounded.turn) == (full.messages(), full.turn)
    with pytest.raises(EventError, match="needs an unbounded log"):
        bounded.messages_at(0)
    if len(bounded.events) != bounded.next_seq:
        with pytest.raises(TurnError, match="needs the History"):
            machine(bounded)


def test_a_bounded_log_refuses_what_an_unbounded_one_refuses_and_stays_as_it_was() -> None:
    events, _ = fixture_log(SHARED_DIR / "fixtures/dsh-format0/tool-call-turn.jsonl")
    bounded = SessionLog("s1", bounded=True)
    bounded.extend(events[:4])
    with pytest.raises(SequenceError):
        bounded.append(events[5])
    bad = Event("user/message", 4, 0, {"role": "user"}, APPEND)
    with pytest.raises(EventError):
        bounded.append(bad)
    assert bounded.next_seq == 4 and list(bounded.events) == open_turn_of(events[:4])


def test_a_resumed_log_refuses_pieces_that_do_not_fit() -> None:
    events, _ = fixture_log(SHARED_DIR / "fixtures/dsh-format0/tool-call-turn.jsonl")
    checkpoint = folded(events[:5])
    turn, surface = checkpoint.turn, SurfaceFold()
    opened = open_turn_of(events[:5])
    pieces: list[tuple[int, Sequence[Event]]] = [
        (6, opened),  # not ending at next_seq - 1
        (5, opened[1:]),  # not from the turn/start
        (5, ())]  # an open turn without its events
    for next_seq, held in pieces:
        with pytest.raises(EventError, match="resumed log"):
            SessionLog.resumed("s1", next_seq=next_seq, turn=turn, surface=surface,
                               events=held)
    with pytest.raises(EventError, match="keep messages"):
        SessionLog.resumed("s1", next_seq=5, turn=turn, events=opened,
                           surface=SurfaceFold(keep_messages=False))


def test_the_checkpoint_does_not_grow_with_events_that_leave_no_state() -> None:
    def session(chunks: int) -> list[Event]:
        events: list[Event] = []

        def add(type_: str, data: JsonValue, op: SurfaceOp | None = None,
                sources: tuple[int, ...] | None = None) -> None:
            events.append(Event(type_, len(events), 0, data, op, sources))

        for turn in range(1, 6):
            add("turn/start", {"turn": turn})
            add("step/start", {"turn": turn, "step": 1})
            add("user/message", {"id": f"u{turn}", "role": "user", "source": {"kind": "user"},
                                 "content": [{"type": "text", "text": "hi"}]}, APPEND)
            first = len(events)
            for _ in range(chunks):
                add("assistant/chunk", {"turn": turn, "step": 1, "chunk": {
                    "type": "text-delta", "index": 0, "text": "x"}})
            add("assistant/message", {"turn": turn, "step": 1, "message": {
                "id": f"a{turn}", "role": "assistant", "source": {"kind": "model"},
                "content": [{"type": "text", "text": "x" * chunks}]}}, APPEND,
                tuple(range(first, len(events))))
            add("step/end", {"turn": turn, "step": 1})
            add("turn/end", {"turn": turn, "reason": {"kind": "completed"}})
        SessionLog.from_events("s", events)  # valid
        return events

    few, many = folded(session(1)).to_json(), folded(session(400)).to_json()
    assert few["openTurn"] == many["openTurn"] == []
    assert few["history"] == many["history"] and few["turn"] == many["turn"]
    messages = [entry[3]["id"] for entry in many["surface"]]
    assert messages == [entry[3]["id"] for entry in few["surface"]]


# -- small pieces ---------------------------------------------------------------------------

def test_busy_follows_open_turns_and_waking_inbox_items() -> None:
    events = driver_log()
    checkpoint = SessionCheckpoint("s1")
    seen: list[tuple[str, bool]] = []
    for event in events:
        checkpoint.advance([event])
        seen.append((event.type, checkpoint.busy))
    first_splice = seen.index(("agent/inbox/spliced", True))
    assert first_splice == 0  # the follow-up queued: work that wakes the session
    assert ("turn/end", False) in seen  # idle between turns
    inject = next(i for i, e in enumerate(events) if e.type == "agent/inbox/spliced"
                  and e.data["inserted"] and e.data["inserted"][0]["id"] == "i1")
    assert seen[inject] == ("agent/inbox/spliced", False)  # injected context does not wake


def test_advance_refuses_a_seq_gap_and_keeps_what_came_before() -> None:
    events = driver_log()
    checkpoint = SessionCheckpoint("s1")
    with pytest.raises(SequenceError, match="expected seq 3, found 4"):
        checkpoint.advance([*events[:3], events[4]])
    assert checkpoint.next_seq == 3 and checkpoint.to_json() == folded(events[:3]).to_json()
    checkpoint.advance(events[3:])
    assert checkpoint.to_json() == folded(events).to_json()


def test_the_writer_mark_and_the_session_survive_json() -> None:
    checkpoint = SessionCheckpoint("s9", writer="dsh-file")
    checkpoint.advance(driver_log()[:3])
    again = through_json(checkpoint)
    assert (again.session_id, again.writer, again.next_seq) == ("s9", "dsh-file", 3)
    assert SessionCheckpoint.from_json(SessionCheckpoint("s0").to_json()).writer is None


def test_surface_json_keeps_messages_only_when_asked() -> None:
    events, _ = fixture_log(SHARED_DIR / "fixtures/dsh-format0/agent-instructions.jsonl")
    fold = SurfaceFold()
    for event in events:
        fold.apply(event)
    full = fold.to_json(with_messages=True)
    restored = SurfaceFold.from_json(json.loads(json.dumps(full)))
    assert restored.keeps_messages and restored.messages() == fold.messages()
    assert restored.to_json() == fold.to_json()  # the compact form is as before
    compact = SurfaceFold.from_json(fold.to_json())
    assert not compact.keeps_messages and compact.seqs() == fold.seqs()
    assert not SurfaceFold.from_json(full, keep_messages=False).keeps_messages
    assert SurfaceFold.from_json([], keep_messages=True).keeps_messages
    assert not SurfaceFold.from_json([]).keeps_messages
    with pytest.raises(ValueError, match="does not keep messages"):
        compact.to_json(with_messages=True)
    with pytest.raises(CodecError):
        SurfaceFold.from_json(fold.to_json(), keep_messages=True)


def _mutated(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The checkpoint of the driver log inside its first open step, then ``change``d."""
    events = driver_log()
    k = next(i for i, e in enumerate(events) if e.type == "tool/call") + 1
    raw: dict[str, Any] = json.loads(json.dumps(folded(events[:k]).to_json()))
    change(raw)
    return raw


DROP = object()
# the legacy and the compact form (no messages), a string seq, a repeated seq
ODD_SURFACES: tuple[Any, ...] = ({"nodes": [], "ops": []}, [[0, 0]], [[0, "0", None, {}]],
                                 [[0, 0, None, {}], [1, 0, None, {}]])
# plain values; (path, value) set in a good checkpoint's JSON (DROP: removed); or a change of
# it (made when the test runs)
GARBAGE: list[Any] = [
    None, [], "checkpoint", 1, {"v": 2}, (("v",), 3), (("v",), True), (("history",), DROP),
    (("extra",), 1), (("session",), 7), (("writer",), []), (("nextSeq",), -1),
    (("nextSeq",), "3"), (("openTurn",), []), (("openTurn",), {}), (("turn",), None),
    (("turn", "openCalls"), [["c", "one", None]]), (("turn", "lastStep"), DROP),
    *[(("surface",), odd) for odd in ODD_SURFACES], (("history",), []),
    (("history", "lastTurn"), None), (("history", "messageIds"), "m1"),
    (("history", "inbox"), {"nextTurn": [1], "nextStep": []}), (("history", "inbox"), None),
    (("history", "approvals", "waiting"), {"id": 1}),
    (("history", "approvals", "verdicts"), []),
    lambda raw: raw.update(nextSeq=raw["nextSeq"] + 1),  # the open turn ends early
    lambda raw: raw.update(openTurn=raw["openTurn"][1:]),  # not from its turn/start
    lambda raw: raw["openTurn"].append({"type": "x"}),
    lambda raw: raw["openTurn"][0].update(seq="0"),
]


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(raw: dict[str, Any]) -> None:
        for key in path[:-1]:
            raw = raw[key]
        if value is DROP:
            del raw[path[-1]]
        else:
            raw[path[-1]] = value
    return change


@pytest.mark.parametrize("garbage", GARBAGE, ids=range(len(GARBAGE)))
def test_from_json_refuses_garbage_with_a_codec_error(garbage: Any) -> None:
    if isinstance(garbage, tuple):
        garbage = _set(*garbage)
    raw = _mutated(garbage) if callable(garbage) else garbage
    with pytest.raises(CodecError):
        SessionCheckpoint.from_json(raw)


def test_an_unknown_version_is_named_and_v1_is_still_read() -> None:
    with pytest.raises(CodecError, match=r"unknown session checkpoint version 3 \(this reader "
                                         r"knows v \[1, 2\]\)"):
        SessionCheckpoint.from_json(_mutated(_set(("v",), 3)))
    # A v1 checkpoint (written with every transaction by older drivers) reads as it was.
    older = _mutated(_set(("v",), 1))
    assert SessionCheckpoint.from_json(older).to_json() == {**older, "v": VERSION}
    assert VERSION == 2
