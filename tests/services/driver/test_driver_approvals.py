"""Durable approval of tool calls through the real Kafka driver (issue 32 part 3).

One in-process :class:`DriverService` serves the module; its runners gate the ``danger`` tool
(``--require-approval danger``), and sessions whose id holds ``timeout`` also get a short
``--approval-timeout``. The scripted model calls ``danger`` once, then answers with what it
got. Every log read back must validate strictly. The kill -9 case runs ``dsh-pipeline
driver`` processes: the wait survives the crash and a restarted driver runs the approved call
once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from test_driver_crash import driver_env
from test_driver_kafka import PARTITIONS, wait_for_events
from wait_support import driver_owning

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.llm.scripted import ScriptedProvider, tool_loop_script
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.inbox import InboxCodec
from pipeline.core.approvals import ApprovalRules
from pipeline.core.events import Event
from pipeline.core.inbox import Approve, Cancel, Deny, FollowUp, InboxCommand, Steer
from pipeline.core.log import SessionLog
from pipeline.core.turn_effects import SessionConfig
from pipeline.core.turn_history import History
from pipeline.services.driver.kafka_sink import PartitionSink
from pipeline.services.driver.runner import SessionRunner
from pipeline.services.driver.service import DriverService
from pipeline.services.driver.tools import ToolRegistry, ToolSpec, builtin_registry
from pipeline.settings import Settings

pytestmark = [pytest.mark.broker, pytest.mark.timeout(420),
              pytest.mark.asyncio(loop_scope="module")]
RULES = ApprovalRules(require=("danger",))
TIMEOUT_RULES = ApprovalRules(require=("danger",), timeout_ms=1500)


@dataclasses.dataclass
class ApprovalDriver:
    settings: Settings
    service: DriverService
    ran: list[str]  # the danger tool's calls, by session

    async def send(self, *commands: InboxCommand) -> None:
        await send_records(self.settings, [
            OutRecord(self.settings.topics.inbox, c.session_id.encode(), InboxCodec().encode(c))
            for c in commands])

    async def start(self, session: str, text: str = "do it") -> None:
        await self.send(FollowUp(session, str(uuid.uuid4()), ({"type": "text", "text": text},)))

    async def until(self, session: str, done: Callable[[list[Event]], bool]) -> list[Event]:
        return await wait_for_events(self.settings, session, done)

    async def waiting(self, session: str) -> str:
        """The call id the session waits on (once its ask is committed)."""
        events = await self.until(session, lambda ev: bool(of_type(ev, "approval/asked")))
        return str(of_type(events, "approval/asked")[-1].data["callId"])

    async def turn_ended(self, session: str, count: int = 1) -> list[Event]:
        events = await self.until(session, lambda ev: len(of_type(ev, "turn/end")) >= count)
        SessionLog.from_events(session, events, mode="strict")  # the log stays valid
        return events


def of_type(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e.type == kind]


def danger_tools(ran: list[str]) -> ToolRegistry:
    async def danger(args: dict[str, Any]) -> str:
        ran.append(str(args.get("target")))
        return f"did {args.get('target')}"

    registry = builtin_registry()
    registry.register(ToolSpec("danger", "Do something a person must approve.",
                               {"type": "object", "properties": {"target": {"type": "string"}}},
                               danger))
    return registry


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def driver(kafka_bootstrap: str) -> AsyncIterator[ApprovalDriver]:
    prefix = f"t{uuid.uuid4().hex[:12]}."
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap, topic_prefix=prefix,
                                 partitions=PARTITIONS, replication_factor=1,
                                 group_id_prefix=f"{prefix}g-")
    await ensure_topics(settings)
    ran: list[str] = []
    tools = danger_tools(ran)
    provider = ScriptedProvider(tool_loop_script("danger", '{"target": "prod"}'))
    config = SessionConfig(provider=settings.provider, model=settings.model)

    def make(log: SessionLog, sink: PartitionSink, history: History) -> SessionRunner:
        rules = TIMEOUT_RULES if "timeout" in log.session_id else RULES
        return SessionRunner(log, provider_factory=lambda _p, _m: provider, tools=tools,
                             sink=sink, config=config, approvals=rules, history=history)

    ctx = dataclasses.replace(driver_context(settings, group_id=f"{prefix}driver", tools=tools,
                                             linger_ms=10), runner_factory=make)
    async with driver_owning(ctx, PARTITIONS) as service:
        yield ApprovalDriver(settings, service, ran)


async def test_approve_runs_the_call_once_and_logs_who(driver: ApprovalDriver) -> None:
    session = f"s-approve-{uuid.uuid4().hex[:6]}"
    await driver.start(session)
    call_id = await driver.waiting(session)
    before = len(driver.ran)
    await driver.send(Approve(session, "a-1", call_id, reason="checked",
                              source={"kind": "user", "name": "alice"}))
    events = await driver.turn_ended(session)
    assert len(driver.ran) == before + 1
    types = [e.type for e in events]
    asked = types.index("approval/asked")
    assert types[asked - 1] == "tool/call" and types[asked + 1:asked + 4] == [
        "dsh-pipeline/approval", "approval/decided", "tool/result"]
    audit = of_type(events, "dsh-pipeline/approval")[0].data
    assert audit["by"] == {"kind": "user", "name": "alice"} and audit["reason"] == "checked"
    assert of_type(events, "approval/decided")[0].data["outcome"] == "allowed-once"
    assert events[-1].data["reason"] == {"kind": "completed"}


async def test_deny_gives_the_model_the_reason(driver: ApprovalDriver) -> None:
    session = f"s-deny-{uuid.uuid4().hex[:6]}"
    await driver.start(session)
    call_id = await driver.waiting(session)
    before = len(driver.ran)
    await driver.send(Deny(session, "d-1", call_id, reason="not on prod"))
    events = await driver.turn_ended(session)
    assert len(driver.ran) == before
    result = of_type(events, "tool/result")[0].data
    assert result["message"]["content"][0]["content"][0]["text"] == \
        'Error: the user rejected tool "danger": not on prod'
    answer = of_type(events, "assistant/message")[-1].data["message"]["content"]
    assert "not on prod" in str(answer)  # the model saw it


async def test_timeout_denies_on_expiry(driver: ApprovalDriver) -> None:
    session = f"s-timeout-{uuid.uuid4().hex[:6]}"
    await driver.start(session)
    await driver.waiting(session)
    events = await driver.turn_ended(session)  # nobody decides
    assert of_type(events, "approval/decided")[0].data["outcome"] == "unavailable"
    assert of_type(events, "dsh-pipeline/approval")[0].data["decision"] == "timeout"
    assert of_type(events, "tool/result")[0].data["error"]["code"] == "APPROVAL_TIMEOUT"


async def evict(driver: ApprovalDriver, session: str) -> None:
    """Evict ``session`` from the driver's memory as the idle sweep does (once its ask is
    committed: before that the sweep leaves it)."""
    owned = driver.service.owned[partition_for(session, PARTITIONS)]

    async def evicted() -> None:
        while session in owned.sessions:
            owned.evict_idle(time.monotonic() + 1)
            await asyncio.sleep(0.05)
    await asyncio.wait_for(evicted(), 30)


async def test_a_waiting_approval_survives_eviction(driver: ApprovalDriver) -> None:
    session = f"s-evicted-{uuid.uuid4().hex[:6]}"
    await driver.start(session)
    call_id = await driver.waiting(session)
    loaded = driver.service.metrics.sessions_loaded
    await evict(driver, session)
    before = len(driver.ran)
    await driver.send(Approve(session, "a-ev", call_id, reason="after eviction"))
    events = await driver.turn_ended(session)
    assert len(driver.ran) == before + 1
    assert driver.service.metrics.sessions_loaded == loaded + 1
    assert of_type(events, "approval/decided")[0].data["outcome"] == "allowed-once"
    assert events[-1].data["reason"] == {"kind": "completed"}


async def test_the_deadline_of_an_evicted_wait_still_denies(driver: ApprovalDriver) -> None:
    session = f"s-timeout-evicted-{uuid.uuid4().hex[:6]}"
    await driver.start(session)
    await driver.waiting(session)
    loaded = driver.service.metrics.sessions_loaded
    await evict(driver, session)
    events = await driver.turn_ended(session)  # nobody decides: the deadline loads it
    assert driver.service.metrics.sessions_loaded == loaded + 1
    assert of_type(events, "dsh-pipeline/approval")[0].data["decision"] == "timeout"
    assert of_type(events, "tool/result")[0].data["error"]["code"] == "APPROVAL_TIMEOUT"


async def test_cancel_while_waiting(driver: ApprovalDriver) -> None:
    session = f"s-cancel-{uuid.uuid4().hex[:6]}"
    await driver.start(session)
    await driver.waiting(session)
    await driver.send(Cancel(session, "x-1"))
    events = await driver.turn_ended(session)
    assert of_type(events, "approval/decided")[0].data["outcome"] == "cancelled"
    assert events[-1].data["reason"] == {"kind": "aborted", "reason": {"kind": "user"}}


async def test_steer_while_waiting_enters_after_the_decision(driver: ApprovalDriver) -> None:
    session = f"s-steer-{uuid.uuid4().hex[:6]}"
    await driver.start(session)
    call_id = await driver.waiting(session)
    await driver.send(Steer(session, "st-1", ({"type": "text", "text": "also this"},)))
    await driver.until(session, lambda ev: bool(of_type(ev, "agent/inbox/spliced")[1:]))
    await driver.send(Approve(session, "a-st", call_id))
    events = await driver.until(session, lambda ev: len(of_type(ev, "user/message")) == 2)
    steer = of_type(events, "user/message")[1]
    assert steer.data["id"] == "st-1" and of_type(events, "turn/end") == []  # same turn
    assert of_type(events, "tool/result")[0].seq < of_type(events, "step/start")[1].seq \
        < steer.seq


async def test_follow_up_while_waiting_is_the_next_turn(driver: ApprovalDriver) -> None:
    session = f"s-follow-{uuid.uuid4().hex[:6]}"
    await driver.start(session)
    call_id = await driver.waiting(session)
    await driver.start(session, "and then this")
    await driver.until(session, lambda ev: bool(of_type(ev, "agent/inbox/spliced")[1:]))
    await driver.send(Approve(session, "a-fu", call_id))
    events = await driver.until(session, lambda ev: len(of_type(ev, "turn/start")) == 2)
    assert of_type(events, "turn/end")[0].data["reason"] == {"kind": "completed"}
    assert of_type(events, "turn/end")[0].seq < of_type(events, "turn/start")[1].seq


async def test_two_decisions_race_one_wins_the_other_is_refused(driver: ApprovalDriver
                                                                ) -> None:
    session = f"s-race-{uuid.uuid4().hex[:6]}"
    await driver.start(session)
    call_id = await driver.waiting(session)
    before = len(driver.ran)
    await driver.send(Approve(session, "race-a", call_id, source={"kind": "user", "name": "a"}),
                      Deny(session, "race-b", call_id, source={"kind": "user", "name": "b"}))
    events = await driver.until(session, lambda ev: bool(
        of_type(ev, "dsh-pipeline/approval-refused")) and bool(of_type(ev, "turn/end")))
    assert len(of_type(events, "approval/decided")) == 1 and len(driver.ran) == before + 1
    refused = of_type(events, "dsh-pipeline/approval-refused")[0].data
    assert refused["messageId"] == "race-b"
    assert refused["refusal"] == (f"refused: tool call {call_id!r} was already approved by "
                                  "user a (message race-a)")
    # a third person, with the CLI: told at once, on stderr, exit 1
    late = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli.main", "send", session, "--deny", call_id,
        "--by", "carol", "--wait", env=driver_env(driver.settings),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(late.communicate(), 60)
    assert late.returncode == 1, err
    assert err.decode().strip() == (f"send: refused: tool call {call_id!r} was already "
                                    "approved by user a (message race-a)")
    assert json.loads(out)["refused"].startswith("refused: ")


async def test_send_wait_prints_the_outcome(driver: ApprovalDriver) -> None:
    session = f"s-wait-{uuid.uuid4().hex[:6]}"
    await driver.start(session)
    call_id = await driver.waiting(session)
    done = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli.main", "send", session, "--approve", call_id,
        "--reason", "fine", "--wait", env=driver_env(driver.settings),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(done.communicate(), 60)
    assert done.returncode == 0, err
    assert json.loads(out)["outcome"] == "allowed-once"


async def start_driver(settings: Settings, *args: str) -> asyncio.subprocess.Process:
    """A ``dsh-pipeline driver`` process, once it printed its ready line."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli.main", "driver", "--instance-id", "approvals",
        "--session-timeout", "6s", "--grace", "1s", "--metrics-port", "-1", *args,
        env=driver_env(settings), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 60)
    assert line.startswith(b"ready"), f"driver exited early ({process.returncode}): {line!r}"
    return process


async def test_kill_9_while_waiting_then_approve_on_a_restarted_driver(
        topics: Settings) -> None:
    settings, session = topics, "s-kill-wait"
    flags = ["--script", "tool-loop", "--require-approval", "echo"]
    process = await start_driver(settings, *flags)
    helper = ApprovalDriver(settings, None, [])  # type: ignore[arg-type]
    try:
        await helper.start(session, "please echo")
        call_id = await helper.waiting(session)
    finally:
        process.kill()  # SIGKILL while the call waits
        await process.wait()
    process = await start_driver(settings, *flags)
    try:
        await helper.send(Approve(session, "after-crash", call_id))
        events = await helper.turn_ended(session)
        await helper.send(Approve(session, "after-crash", call_id))  # redelivered: no effect
        await helper.start(session, "again")
        events = await helper.until(session, lambda ev: len(of_type(ev, "approval/asked")) == 2)
    finally:
        process.kill()
        await process.wait()
    first_turn = [e for e in events if e.seq <= of_type(events, "turn/end")[0].seq]
    assert of_type(first_turn, "turn/end")[0].data["reason"] == {"kind": "completed"}
    assert len(of_type(first_turn, "tool/call")) == 1  # recorded once, run once
    result = of_type(first_turn, "tool/result")[0].data
    assert not result["message"]["content"][0]["isError"]
    assert len(of_type(events, "dsh-pipeline/approval")) == 1
    assert not of_type(events, "dsh-pipeline/approval-refused")
