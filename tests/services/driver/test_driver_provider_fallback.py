"""A provider failing over to its fallback (issue 30), against two local protocol servers.

Two named endpoints (``DSH_PROVIDERS``: a DeepSeek-kind primary and an OpenAI-compatible
backup, each with its own key read from the variable its ``apiKeyEnv`` names) and one
fallback (``DSH_PROVIDER_FALLBACKS``). An in-memory driver runs a session's turns while the
primary answers 500s, refuses with a 429 and a long Retry-After, or is down: the turn
completes on the backup, its ``assistant/message`` naming the backup; while the primary cools
off the next turns go straight to the backup; once it has recovered and the cool-off is over
it answers again. A primary over its rate budget sends the step to the backup without
waiting. The router's (and the gate's) clock is the test's: no assertion waits for time.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from llm_server import LLMTestServer, ScriptedResponse, chat_chunk, error_body

from pipeline.adapters.llm.endpoints import ProviderEndpoint, parse_providers
from pipeline.adapters.llm.factory import provider_from_settings
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.model import RetryPolicy
from pipeline.core.provider_routes import ROUTE_TYPE, parse_fallbacks
from pipeline.core.rate_budget import Limit, ProviderLimits
from pipeline.core.turn_config import config_disagreements
from pipeline.core.turn_effects import SessionConfig
from pipeline.core.usage import UsageScan
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.provider_gate import ProviderGate
from pipeline.services.driver.provider_router import ProviderRouter
from pipeline.services.driver.runner import ModelProvider
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Settings

PRIMARY_KEY, BACKUP_KEY = "sk-primary-must-stay-secret-2718", "sk-backup-must-stay-secret-1618"
ENV = {"PRIMARY_API_KEY": PRIMARY_KEY, "BACKUP_API_KEY": BACKUP_KEY}
PRIMARY, BACKUP = {"provider": "primary", "model": "deepseek-chat"}, \
    {"provider": "backup", "model": "gpt-4o-mini"}
COOL_OFF_S = 30.0


def answer(text: str) -> ScriptedResponse:
    return ScriptedResponse(events=[chat_chunk(content=text), chat_chunk(
        finish_reason="stop", usage={"prompt_tokens": 20, "completion_tokens": 3})])


FAILURES = {
    "500s": ScriptedResponse(status=500, body=error_body("upstream down", "server_error")),
    "429 with a long Retry-After": ScriptedResponse(
        status=429, body=error_body("Rate limit reached", "rate_limit_error"),
        headers={"Retry-After": "120"}),
}


@dataclass
class Primary:
    """The primary server's behaviour, switched by the test."""

    failure: ScriptedResponse | None = None

    def __call__(self, _body: Any) -> ScriptedResponse:
        return self.failure if self.failure is not None else answer("from primary")


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Fleet:
    primary: LLMTestServer
    backup: LLMTestServer
    behaviour: Primary
    clock: Clock = field(default_factory=Clock)
    made: list[ModelProvider] = field(default_factory=list)
    router: ProviderRouter | None = None

    def endpoints(self) -> dict[str, ProviderEndpoint]:
        return parse_providers(json.loads(json.dumps({
            "primary": {"kind": "deepseek", "baseURL": self.primary.base_url,
                        "apiKeyEnv": "PRIMARY_API_KEY"},
            "backup": {"kind": "openai-compatible", "baseURL": self.backup.base_url + "/v1",
                       "apiKeyEnv": "BACKUP_API_KEY"}})), ENV)

    def driver(self, gate: ProviderGate | None = None, max_wait_s: float = 10.0,
               model: str = "deepseek-chat") -> Driver:
        endpoints = self.endpoints()
        fallbacks = parse_fallbacks(
            {"primary/deepseek-chat": ["backup/gpt-4o-mini"],
             "policy": {"cool_off_s": COOL_OFF_S, "max_wait_s": max_wait_s}},
            known_providers=set(endpoints))
        providers: dict[str, ModelProvider] = {}

        def factory(provider: str, _model: str) -> ModelProvider:
            if provider not in providers:
                providers[provider] = provider_from_settings(Settings(), provider,
                                                             endpoints=endpoints)
                self.made.append(providers[provider])
            return providers[provider]

        self.router = ProviderRouter(fallbacks, gate=gate, clock=self.clock)
        return Driver(provider_factory=factory, tools=builtin_registry(),
                      config=SessionConfig("primary", model),
                      retry=RetryPolicy(max_attempts=2, base_ms=0, max_ms=0),
                      jitter=lambda: 0.0, gate=gate,
                      router=self.router)

    async def close(self) -> None:
        for provider in self.made:
            await provider.aclose()  # type: ignore[attr-defined]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    behaviour = Primary()
    primary, backup = LLMTestServer(behaviour), LLMTestServer(lambda _b: answer("from backup"))
    await primary.start()
    await backup.start()
    test_fleet = Fleet(primary, backup, behaviour)
    yield test_fleet
    await test_fleet.close()
    await primary.stop()
    await backup.stop()


async def turn(driver: Driver, session: str, message_id: str) -> list[Event]:
    """Run one turn of ``session``; the events it appended."""
    sink = driver.sink
    assert isinstance(sink, MemorySink)
    before = len(sink.events.get(session, []))
    driver.submit(FollowUp(session, message_id, ({"type": "text", "text": "hi"},)))
    await driver.drain()
    return sink.events[session][before:]


def of_type(events: list[Event], type_: str) -> list[Event]:
    return [e for e in events if e.type == type_]


def answered_by(events: list[Event]) -> dict[str, Any]:
    [message] = of_type(events, "assistant/message")
    [end] = of_type(events, "turn/end")
    assert end.data["reason"] == {"kind": "completed"}  # type: ignore[index]
    source = message.data["message"]["source"]  # type: ignore[index]
    return {"provider": source["provider"], "model": source["model"]}


async def take_primary_down(fleet: Fleet, how: str) -> tuple[int, float]:
    """Make the primary fail ``how``; the calls it will get before the turn leaves it, and
    how long it is then avoided."""
    if how == "down":
        await fleet.primary.stop()  # nothing listens on its port: connections are refused
        return 0, COOL_OFF_S
    fleet.behaviour.failure = FAILURES[how]
    if how == "500s":
        return 2, COOL_OFF_S          # the retry policy's two attempts, then the fallback
    return 1, 120.0                   # a Retry-After beyond the wait bound: at once, 120 s


async def bring_primary_back(fleet: Fleet, how: str) -> None:
    fleet.behaviour.failure = None
    if how == "down":
        port = int(fleet.primary.base_url.rsplit(":", 1)[1])
        fleet.primary = LLMTestServer(fleet.behaviour, port=port)
        await fleet.primary.start()


@pytest.mark.parametrize("how", ["500s", "429 with a long Retry-After", "down"])
async def test_a_failing_primary_fails_over_and_is_used_again_after_its_cool_off(
        fleet: Fleet, how: str) -> None:
    driver = fleet.driver()
    primary_calls, cool_off = await take_primary_down(fleet, how)
    events = await turn(driver, "s1", "m1")

    assert answered_by(events) == BACKUP
    assert fleet.primary.request_count == primary_calls
    [moved] = [e for e in of_type(events, "llm/retry") if "fallback" in e.data]  # type: ignore[operator]
    assert moved.data["fallback"] == BACKUP  # type: ignore[index]
    [route] = of_type(events, ROUTE_TYPE)
    assert route.data == {**BACKUP, "reason": "failed", "primary": PRIMARY}
    header = of_type(events, "request/header")[-1]
    assert header.data["header"]["config"] == BACKUP  # type: ignore[index]
    [request] = fleet.backup.requests
    assert request.body["model"] == "gpt-4o-mini"
    assert request.headers["Authorization"] == f"Bearer {BACKUP_KEY}"

    # while the primary cools off, the next turn goes straight to the backup
    fleet.clock.now += cool_off - 1
    later = await turn(driver, "s1", "m2")
    assert answered_by(later) == BACKUP
    assert fleet.primary.request_count == primary_calls
    assert of_type(later, "request/header") == [] and of_type(later, ROUTE_TYPE) == []

    # recovered, and the cool-off is over: the primary answers again
    await bring_primary_back(fleet, how)
    fleet.clock.now += 1
    back = await turn(driver, "s1", "m3")
    assert answered_by(back) == PRIMARY
    [route] = of_type(back, ROUTE_TYPE)
    assert route.data == {**PRIMARY, "reason": "primary", "primary": PRIMARY}
    assert of_type(back, "request/header")[0].data["header"]["config"] == PRIMARY  # type: ignore[index]

    log = driver.runners["s1"].log.events
    assert config_disagreements(log) == []
    scan = UsageScan()
    scan.add_log("s1", log)
    assert scan.by_model["backup/gpt-4o-mini"].input_tokens == 40  # two answers of 20
    assert scan.by_model["primary/deepseek-chat"].input_tokens == 20
    text = json.dumps([e.data for e in log])
    assert PRIMARY_KEY not in text and BACKUP_KEY not in text
    assert fleet.router is not None  # what the driver's /metrics shows
    assert (fleet.router.counters.failovers, fleet.router.counters.fallback_steps) == (1, 1)


async def test_a_primary_over_its_budget_sends_the_step_to_the_backup(fleet: Fleet) -> None:
    clock = fleet.clock
    gate = ProviderGate(ProviderLimits({"primary/*": Limit(requests_per_minute=2)}),
                        clock=clock)
    driver = fleet.driver(gate, max_wait_s=1.0)
    assert answered_by(await turn(driver, "a", "m1")) == PRIMARY  # the budget's one call
    over = await turn(driver, "b", "m1")  # the primary's next grant is ~3 s away
    assert answered_by(over) == BACKUP
    [route] = of_type(over, ROUTE_TYPE)
    assert route.data == {**BACKUP, "reason": "over-budget", "primary": PRIMARY}
    assert fleet.primary.request_count == 1 and gate.counters.grants == 1
    clock.now += 60.0  # the budget refilled
    assert answered_by(await turn(driver, "c", "m1")) == PRIMARY
    assert fleet.primary.request_count == 2


async def test_a_model_without_fallbacks_still_ends_its_turn_with_the_error(
        fleet: Fleet) -> None:
    fleet.behaviour.failure = FAILURES["500s"]
    driver = fleet.driver(model="deepseek-reasoner")  # no fallbacks named for it
    events = await turn(driver, "s1", "m1")
    [end] = of_type(events, "turn/end")
    assert end.data["reason"]["kind"] == "error"  # type: ignore[index]
    assert end.data["reason"]["error"]["code"] == "SERVER"  # type: ignore[index]
    assert fleet.primary.request_count == 2 and fleet.backup.request_count == 0
    assert of_type(events, ROUTE_TYPE) == []
