"""Inbox commands through the real Kafka driver: steer, inject, cancel, configure, hooks, retries.

One :class:`DriverService` serves the whole module (its own topics and group), so the group
join is paid once. Each test uses its own session; the scripted provider picks its behaviour
from the session's first user text (the scenario), the runners get a rejecting pre-step hook
and a fast retry policy. Commands go onto the inbox topic encoded by ``InboxCodec``; the
session topic is read back read_committed and every log must validate strictly.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest
import pytest_asyncio
from test_driver_kafka import PARTITIONS, session_events, wait_for_events
from wait_support import driver_owning

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.llm.scripted import (
    ScriptedError,
    ScriptedProvider,
    ScriptedReply,
    ScriptedToolCall,
)
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.inbox import InboxCodec
from pipeline.core.events import Event
from pipeline.core.inbox import Cancel, Configure, FollowUp, InboxCommand, Inject, Steer
from pipeline.core.log import SessionLog
from pipeline.core.model import ModelRequest, RetryPolicy
from pipeline.core.turn_config import CONFIG_TYPE
from pipeline.core.turn_effects import HookDecision, SessionConfig
from pipeline.core.turn_history import History
from pipeline.services.driver.hooks import Messages, NextHook, PreStepContext, reject
from pipeline.services.driver.kafka_sink import PartitionSink
from pipeline.services.driver.runner import SessionRunner
from pipeline.services.driver.service import DriverService
from pipeline.services.driver.tools import SLEEP, ToolRegistry, builtin_registry
from pipeline.settings import Settings

pytestmark = [pytest.mark.broker, pytest.mark.timeout(420),
              pytest.mark.asyncio(loop_scope="module")]
LONG_ANSWER = "a rather long answer " * 8
FAST_RETRY = RetryPolicy(max_attempts=3, base_ms=1, max_ms=2)
NAP_MS = 3000  # time to send a command while the tool runs, even on a loaded machine


# -- the scripted model: behaviour chosen by the session's first user text ---------------------


def _texts(message: Any) -> str:
    content = message.get("content") if isinstance(message, Mapping) else None
    if isinstance(content, str):
        return content
    return " ".join(str(b.get("text", "")) for b in content or ()
                    if isinstance(b, Mapping) and b.get("type") == "text")


class ScenarioModel:
    """A script that answers by scenario and remembers every request it was sent."""

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []

    def __call__(self, request: ModelRequest, attempt: int) -> ScriptedReply:
        self.requests.append(request)
        users = [m for m in request.messages if isinstance(m, Mapping) and m.get("role") == "user"]
        scenario = _texts(users[0]) if users else ""
        steps = sum(1 for m in request.messages
                    if isinstance(m, Mapping) and m.get("role") == "assistant")
        return self._reply(scenario, steps, attempt)

    @staticmethod
    def _reply(scenario: str, steps: int, attempt: int) -> ScriptedReply:
        if scenario == "nap then answer" and steps == 0:
            return ScriptedReply(tool_calls=(ScriptedToolCall("nap", f'{{"ms": {NAP_MS}}}'),))
        if scenario == "nap then echo" and steps == 0:
            return ScriptedReply(tool_calls=(ScriptedToolCall("nap", f'{{"ms": {NAP_MS}}}'),
                                             ScriptedToolCall("echo", '{"text": "never"}')))
        if scenario == "stream slowly":
            # about 4 s of streaming; the cancel cuts it short after the first text chunk
            return ScriptedReply(text=LONG_ANSWER, pieces=80, chunk_delay_ms=50)
        if scenario == "flaky once" and attempt == 1:
            return ScriptedReply(text="partial", error=ScriptedError("RATE_LIMIT",
                                                                     after_chunks=2))
        if scenario == "always failing":
            return ScriptedReply(error=ScriptedError("SERVER", status=503))
        return ScriptedReply(text=f"answer {steps + 1}")


async def gatekeeper(context: PreStepContext, messages: Messages,
                     next_hook: NextHook) -> HookDecision:
    """Rejects any step whose claimed messages mention 'forbidden'."""
    if "forbidden" in str(messages):
        return reject("policy: forbidden words")
    return await next_hook(messages)


def command_tools() -> ToolRegistry:
    """The built-ins plus ``nap``: ``sleep`` run alone, so a following call stays unstarted."""
    registry = builtin_registry()
    registry.register(dataclasses.replace(SLEEP, name="nap", parallel_safe=False))
    return registry


# -- one driver for the module -------------------------------------------------------------


@dataclasses.dataclass
class CommandDriver:
    settings: Settings
    model: ScenarioModel
    service: DriverService

    async def send(self, command: InboxCommand) -> None:
        record = OutRecord(self.settings.topics.inbox, command.session_id.encode(),
                           InboxCodec().encode(command))
        await send_records(self.settings, [record])

    async def followup(self, session: str, text: str) -> str:
        message_id = str(uuid.uuid4())
        await self.send(FollowUp(session, message_id, ({"type": "text", "text": text},)))
        return message_id

    async def until(self, session: str, done: Callable[[list[Event]], bool]) -> list[Event]:
        return await wait_for_events(self.settings, session, done)

    async def turns_ended(self, session: str, count: int) -> list[Event]:
        return await self.until(session, lambda ev: len(turn_ends(ev)) == count)


def runner_factory(settings: Settings, model: ScenarioModel
                   ) -> Callable[[SessionLog, PartitionSink, History], SessionRunner]:
    provider = ScriptedProvider(model)
    tools = command_tools()
    config = SessionConfig(provider=settings.provider, model=settings.model)

    def make(log: SessionLog, sink: PartitionSink, history: History) -> SessionRunner:
        return SessionRunner(log, provider_factory=lambda _p, _m: provider, tools=tools,
                             sink=sink, hooks=[gatekeeper], config=config, retry=FAST_RETRY,
                             jitter=lambda: 0.0, history=history)
    return make


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def driver(kafka_bootstrap: str) -> AsyncIterator[CommandDriver]:
    prefix = f"t{uuid.uuid4().hex[:12]}."
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap, topic_prefix=prefix,
                                 partitions=PARTITIONS, replication_factor=1,
                                 group_id_prefix=f"{prefix}g-")
    await ensure_topics(settings)
    model = ScenarioModel()
    ctx = driver_context(settings, group_id=f"{prefix}driver", tools=command_tools(),
                         linger_ms=10)
    ctx = dataclasses.replace(ctx, runner_factory=runner_factory(settings, model))
    async with driver_owning(ctx, PARTITIONS) as service:
        yield CommandDriver(settings, model, service)


# -- helpers -------------------------------------------------------------------------------


def turn_ends(events: list[Event]) -> list[Event]:
    return [e for e in events if e.type == "turn/end"]


def strict(session: str, events: list[Event]) -> SessionLog:
    return SessionLog.from_events(session, events, mode="strict")


def of_type(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e.type == kind]


def has_text_chunk(events: list[Event]) -> bool:
    return any(e.type == "assistant/chunk" and e.data["chunk"]["type"] == "text-delta"
               for e in events)


def spliced_ids(event: Event) -> list[str]:
    return [str(m["id"]) for m in event.data.get("inserted", ())]


# -- tests ---------------------------------------------------------------------------------


async def test_steer_during_a_tool_enters_the_next_step(driver: CommandDriver) -> None:
    session = "s-steer"
    await driver.followup(session, "nap then answer")
    await driver.until(session, lambda ev: any(e.type == "tool/call" for e in ev))
    steer_id = str(uuid.uuid4())
    await driver.send(Steer(session, steer_id, ({"type": "text", "text": "be brief"},)))
    events = await driver.turns_ended(session, 1)
    log = strict(session, events)
    assert turn_ends(events)[0].data["reason"] == {"kind": "completed"}
    assert len(of_type(events, "turn/start")) == 1  # the steer joined the running turn
    step_two = next(e for e in events if e.type == "step/start" and e.data["step"] == 2)
    entered = [e for e in events if e.type == "user/message" and e.seq > step_two.seq]
    assert [e.data["id"] for e in entered] == [steer_id]
    roles = [(m["role"], m.get("id")) for m in log.messages()]
    assert roles[-2] == ("user", steer_id) and roles[-1][0] == "assistant"
    sent = [r for r in driver.model.requests if any(
        isinstance(m, Mapping) and m.get("id") == steer_id for m in r.messages)]
    assert len(sent) == 1 and sent[0].messages[-1]["id"] == steer_id


async def test_inject_does_not_wake_and_enters_the_next_turn(driver: CommandDriver) -> None:
    session = "s-inject"
    inject_id = str(uuid.uuid4())
    await driver.send(Inject(session, inject_id, ({"type": "text", "text": "FYI: it rains"},)))
    queued = await driver.until(session, lambda ev: any(
        inject_id in spliced_ids(e) for e in ev if e.type == "agent/inbox/spliced"))
    assert of_type(queued, "turn/start") == []  # logged as queued, no turn started
    followup_id = await driver.followup(session, "what is the weather?")
    events = await driver.turns_ended(session, 1)
    strict(session, events)
    assert len(of_type(events, "turn/start")) == 1
    entered = [e.data["id"] for e in of_type(events, "user/message")]
    assert set(entered) == {inject_id, followup_id}


async def test_cancel_mid_stream_interrupts_the_assistant_message(
        driver: CommandDriver) -> None:
    session = "s-cancel-stream"
    await driver.followup(session, "stream slowly")
    await driver.until(session, has_text_chunk)
    await driver.send(Cancel(session, str(uuid.uuid4())))
    events = await driver.turns_ended(session, 1)
    strict(session, events)
    assert turn_ends(events)[0].data["reason"] == {"kind": "aborted", "reason": {"kind": "user"}}
    [message] = of_type(events, "assistant/message")
    assert message.data["interrupted"] is True
    streamed = "".join(e.data["chunk"]["text"] for e in of_type(events, "assistant/chunk")
                       if e.data["chunk"]["type"] == "text-delta")
    assert message.data["message"]["content"] == [{"type": "text", "text": streamed}]
    assert 0 < len(streamed) < len(LONG_ANSWER)
    assert [e.type for e in events][-2:] == ["step/end", "turn/end"]


async def test_cancel_during_tools_drains_started_and_closes_unstarted_calls(
        driver: CommandDriver) -> None:
    session = "s-cancel-tools"
    await driver.followup(session, "nap then echo")
    await driver.until(session, lambda ev: any(e.type == "tool/call" for e in ev))
    await driver.send(Cancel(session, str(uuid.uuid4())))
    events = await driver.turns_ended(session, 1)
    log = strict(session, events)
    assert turn_ends(events)[0].data["reason"] == {"kind": "aborted", "reason": {"kind": "user"}}
    assert [e.data["name"] for e in of_type(events, "tool/call")] == ["nap"]  # echo never ran
    results = of_type(events, "tool/result")
    assert len(results) == 2
    assert results[0].data["message"]["content"][0]["isError"] is False  # drained, not killed
    assert results[1].data["error"]["code"] == "TOOL_CANCELED"
    assert not log.turn.open_calls


async def test_configure_changes_the_model_of_the_next_request_header(
        driver: CommandDriver) -> None:
    session = "s-configure"
    await driver.followup(session, "first, with the default model")
    await driver.turns_ended(session, 1)
    configure_id = str(uuid.uuid4())
    await driver.send(Configure(session, configure_id, model="scripted-2", tools=("echo",)))
    await driver.followup(session, "then with the configured one")
    events = await driver.turns_ended(session, 2)
    strict(session, events)
    headers = [e.data["header"] for e in of_type(events, "request/header")]
    assert [h["config"]["model"] for h in headers] == ["scripted-1", "scripted-2"]
    [config] = of_type(events, CONFIG_TYPE)  # logged when applied, stated by the next header
    assert config.ignorable is True
    assert config.data == {"messageId": configure_id, "header": headers[-1]}
    assert [t["name"] for t in headers[-1]["tools"]] == ["echo"]
    last = [r for r in driver.model.requests if any(
        "then with the configured one" in _texts(m) for m in r.messages)]
    assert [r.model for r in last] == ["scripted-2"]


async def test_a_rejecting_pre_step_hook_blocks_the_turn(driver: CommandDriver) -> None:
    session = "s-hook"
    await driver.followup(session, "some forbidden words")
    await driver.followup(session, "fine words")
    events = await driver.turns_ended(session, 2)
    strict(session, events)
    reasons = [e.data["reason"]["kind"] for e in turn_ends(events)]
    assert reasons == ["blocked", "completed"]
    first_end = turn_ends(events)[0].seq
    assert not [e for e in events[:first_end] if e.type == "step/start"]  # step-less turn
    assert not [r for r in driver.model.requests if "forbidden" in str(r.messages)]


async def test_retry_then_success(driver: CommandDriver) -> None:
    session = "s-retry"
    await driver.followup(session, "flaky once")
    events = await driver.turns_ended(session, 1)
    strict(session, events)
    assert turn_ends(events)[0].data["reason"] == {"kind": "completed"}
    assert len(of_type(events, "llm/retry")) == 1
    assert len(of_type(events, "llm/retry-started")) == 1


async def test_retries_exhausted_end_the_turn_with_an_error(driver: CommandDriver) -> None:
    session = "s-exhausted"
    await driver.followup(session, "always failing")
    events = await driver.turns_ended(session, 1)
    strict(session, events)
    reason = turn_ends(events)[0].data["reason"]
    assert reason["kind"] == "error" and reason["error"]["code"] == "SERVER"
    assert len(of_type(events, "llm/retry")) == FAST_RETRY.max_attempts - 1
    assert await session_events(driver.settings, session) == events  # nothing after the end
