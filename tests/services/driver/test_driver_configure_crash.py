"""A configure applied and committed just before a ``kill -9`` of the driver is not lost.

Driver processes (``dsh-pipeline driver``, scripted provider) on a real broker: the first one
applies two configures (one to a session that already ran a turn, one to a new session) and
commits their inbox offsets; it is then killed with SIGKILL before any turn used them. A new
driver process takes the partitions, rebuilds the sessions from the session topic, and the
next follow-up of each session runs with the configured provider and model.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from collections.abc import Callable

import pytest
from test_driver_crash import all_events, inbox_drained, start_driver

from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.inbox import InboxCodec
from pipeline.core.events import Event
from pipeline.core.inbox import Configure, FollowUp, InboxCommand
from pipeline.core.log import SessionLog
from pipeline.core.turn_config import CONFIG_TYPE, config_disagreements
from pipeline.settings import Settings

pytestmark = [pytest.mark.broker, pytest.mark.timeout(480)]
TURNED, FRESH = "s-configured-after-a-turn", "s-configured-first"
API_KEY = "sk-test-must-never-reach-the-log-31415"
DRIVER_ENV = {"DSH_DEEPSEEK_API_KEY": API_KEY, "DSH_PROVIDER": "scripted",
              "DSH_MODEL": "scripted-default"}
WAIT_S = 90.0
Logs = dict[str, list[Event]]


async def send(settings: Settings, *commands: InboxCommand) -> None:
    codec = InboxCodec()
    await send_records(settings, [OutRecord(settings.topics.inbox, c.session_id.encode(),
                                            codec.encode(c)) for c in commands])


def follow_up(session: str, message_id: str, text: str) -> FollowUp:
    return FollowUp(session, message_id, ({"type": "text", "text": text},))


def of_type(events: list[Event], type_: str) -> list[Event]:
    return [e for e in events if e.type == type_]


def turns_ended(logs: Logs, session: str) -> int:
    return len(of_type(logs.get(session, []), "turn/end"))


async def until(settings: Settings, done: Callable[[Logs], bool], what: str) -> Logs:
    """Poll until the driver group's inbox offsets are at the end and then the session
    topic satisfies ``done``; the logs read after the offsets hold what they committed."""
    async def poll() -> Logs:
        while True:
            if await inbox_drained(settings):
                logs = await all_events(settings)
                if done(logs):
                    return logs
            await asyncio.sleep(0.3)
    try:
        return await asyncio.wait_for(poll(), WAIT_S)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT_S} s: {what}") from None


async def stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.kill()
        await process.wait()


async def test_a_configure_committed_before_a_kill_9_is_used_by_the_next_owner(
        topics: Settings) -> None:
    configure_turned = Configure(TURNED, "c-turned", model="configured-model", system="be brief",
                                 tools=("echo",), reasoning_effort="high", max_tokens=64)
    configure_fresh = Configure(FRESH, "c-fresh", provider="scripted", model="fresh-model")
    first = await start_driver(topics, DRIVER_ENV)
    try:
        await send(topics, follow_up(TURNED, "f-1", "before the configure"))
        await until(topics, lambda logs: turns_ended(logs, TURNED) == 1, "the first turn")
        await send(topics, configure_turned, configure_fresh)
        # the driver group's inbox offset is past both configures: they count as applied
        at_kill = await until(topics, lambda logs: True, "both configures committed")
    finally:
        await stop(first)  # SIGKILL: no shutdown, no chance to write anything more

    second = await start_driver(topics, DRIVER_ENV)
    try:
        await send(topics, follow_up(TURNED, "f-2", "after the kill"),
                   follow_up(FRESH, "f-3", "first words"))
        logs = await until(topics, lambda logs: turns_ended(logs, TURNED) == 2
                           and turns_ended(logs, FRESH) == 1, "the follow-ups' turns")
        second.send_signal(signal.SIGTERM)
        await asyncio.wait_for(second.communicate(), 30)
        assert second.returncode == 0
    finally:
        await stop(second)

    check_configured_turn(logs[TURNED], "configured-model", "change")
    check_configured_turn(logs[FRESH], "fresh-model", "initial")
    # what the killed driver had committed: both configures logged, no turn had used them
    assert turns_ended(at_kill, TURNED) == 1 and turns_ended(at_kill, FRESH) == 0
    assert [len(of_type(at_kill.get(s, []), CONFIG_TYPE)) for s in (TURNED, FRESH)] == [1, 1]
    headers = of_type(at_kill[TURNED], "request/header")
    assert [h.data["header"]["config"]["model"] for h in headers] == ["scripted-default"]
    turned_header = of_type(logs[TURNED], "request/header")[-1].data["header"]
    assert turned_header["system"] == "be brief"
    assert turned_header["config"] == {"provider": "scripted", "model": "configured-model",
                                       "reasoningEffort": "high", "maxTokens": 64}
    assert [t["name"] for t in turned_header["tools"]] == ["echo"]
    for session, events in logs.items():
        SessionLog.from_events(session, events, mode="strict")  # whole, valid, no repeats
        assert config_disagreements(events) == []
        assert API_KEY not in json.dumps([e.to_json() for e in events])
        ids = Counter(e.data["messageId"] for e in of_type(events, CONFIG_TYPE))
        assert set(ids.values()) == {1}, f"{session}: a configure was applied twice: {ids}"


def check_configured_turn(events: list[Event], model: str, reason: str) -> None:
    """The session's last turn was asked with ``model``; its header states the configure."""
    assert of_type(events, "turn/end")[-1].data["reason"] == {"kind": "completed"}
    answer = of_type(events, "assistant/message")[-1]
    assert answer.data["message"]["source"]["provider"] == "scripted"
    assert answer.data["message"]["source"]["model"] == model
    header = of_type(events, "request/header")[-1]
    [config] = of_type(events, CONFIG_TYPE)
    assert config.seq < header.seq < answer.seq
    assert header.data == {"header": config.data["header"], "reason": reason}
