"""Drivers sharing one provider budget (issue 30) against a local server that enforces a
requests-per-minute limit as providers do (429 + Retry-After + x-ratelimit-*).

Two in-memory drivers, each with its gate at half the fleet's limit (as two drivers owning
half the partitions each), run more turns than the limit allows at once: none is refused,
every turn ends, and the calls beyond the first minute's share are spread by the refill.
The same load without gates is refused by the server: the limit is real."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from llm_server import LLMTestServer, RateLimits, ScriptedResponse, chat_chunk

from pipeline.adapters.llm import DeepSeekProvider
from pipeline.adapters.llm.http_provider import parse_reset_s, rate_signal_of
from pipeline.core.events import Event
from pipeline.core.fleet import FleetStatus
from pipeline.core.inbox import FollowUp
from pipeline.core.model import RetryPolicy
from pipeline.core.rate_budget import (
    PROVIDER_GRANTED_TYPE,
    PROVIDER_WAIT_TYPE,
    Limit,
    ProviderLimits,
    RateSignal,
)
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.provider_gate import ProviderGate
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Secret

LIMIT_RPM = 60        # the fleet's: 30 per driver
TURNS_PER_DRIVER = 34  # 68 calls: 60 at once, then 8 more spread by the refill (1/s)


def answer(_body: Any) -> ScriptedResponse:
    return ScriptedResponse(events=[chat_chunk(content="ok"), chat_chunk(
        finish_reason="stop", usage={"prompt_tokens": 20, "completion_tokens": 1})])


@pytest.fixture
async def server() -> AsyncIterator[LLMTestServer]:
    test_server = LLMTestServer(answer, keep_requests=False,
                                limits=RateLimits(requests_per_minute=LIMIT_RPM))
    await test_server.start()
    yield test_server
    await test_server.stop()


async def run_fleet(server: LLMTestServer, gates: list[ProviderGate | None], prefix: str
                    ) -> dict[str, list[Event]]:
    """One driver per gate, ``TURNS_PER_DRIVER`` sessions each with one turn; every
    session's events."""
    provider = DeepSeekProvider(Secret("sk-budget"), server.base_url, trust_env=False)
    config = SessionConfig("deepseek", "deepseek-chat")
    drivers = [Driver(provider_factory=lambda _p, _m: provider, tools=builtin_registry(),
                      config=config, retry=RetryPolicy(max_attempts=1), jitter=lambda: 0.0,
                      gate=gate) for gate in gates]
    try:
        for n, driver in enumerate(drivers):
            for turn in range(TURNS_PER_DRIVER):
                driver.submit(FollowUp(f"{prefix}{n}-{turn}", "m0",
                                       ({"type": "text", "text": "hi"},)))
        await asyncio.gather(*(driver.drain() for driver in drivers))
    finally:
        await provider.aclose()
    logs: dict[str, list[Event]] = {}
    for driver in drivers:
        assert isinstance(driver.sink, MemorySink)
        logs.update(driver.sink.events)
    return logs


def end_kinds(logs: dict[str, list[Event]]) -> list[list[str]]:
    return [[str(e.data["reason"]["kind"]) for e in events  # type: ignore[index]
             if e.type == "turn/end"] for events in logs.values()]


async def test_two_drivers_share_the_limit_and_none_is_refused(server: LLMTestServer) -> None:
    limits = ProviderLimits({"deepseek/*": Limit(requests_per_minute=LIMIT_RPM)})
    gates = [ProviderGate(limits, share=0.5), ProviderGate(limits, share=0.5)]
    started = time.monotonic()
    logs = await run_fleet(server, list(gates), "shared-")
    ends = end_kinds(logs)
    elapsed = time.monotonic() - started
    assert server.limits is not None
    assert server.limits.rejected == 0
    assert ends == [["completed"]] * (2 * TURNS_PER_DRIVER)
    # 60 at once, the 8 others at the refill's pace (one a second for the fleet): the gates
    # held them back rather than let the server refuse them.
    assert sum(g.counters.grants for g in gates) == 2 * TURNS_PER_DRIVER
    assert max(g.counters.longest_wait_s for g in gates) >= 3.0
    assert elapsed >= 3.0
    # a step that waited says so in its log, and the fleet row showed it until the grant
    waited = {sid: events for sid, events in logs.items()
              if any(e.type == PROVIDER_WAIT_TYPE for e in events)}
    assert len(waited) >= 2 * TURNS_PER_DRIVER - LIMIT_RPM
    for events in waited.values():
        notes = [e for e in events if e.type.startswith("dsh-pipeline/provider-")]
        assert [e.type for e in notes] == [PROVIDER_WAIT_TYPE, PROVIDER_GRANTED_TYPE]
        assert all(e.ignorable for e in notes)
        assert notes[1].data["waitedMs"] >= 0  # type: ignore[index,operator]
        row = FleetStatus("s")
        for event in events[:notes[0].seq + 1]:
            row.apply(event)
        assert (row.provider_wait, row.provider_wait_since_ms) == (
            "deepseek/deepseek-chat", notes[0].time)
        for event in events[notes[0].seq + 1:]:
            row.apply(event)
        assert row.provider_wait is None


async def test_the_same_load_without_gates_is_refused(server: LLMTestServer) -> None:
    ends = end_kinds(await run_fleet(server, [None, None], "free-"))
    assert server.limits is not None
    assert server.limits.rejected == 2 * TURNS_PER_DRIVER - LIMIT_RPM
    assert sum(1 for kinds in ends if kinds != ["completed"]) == server.limits.rejected


def test_reset_durations_and_rate_headers_parse_as_providers_send_them() -> None:
    assert parse_reset_s("6m0s") == 360.0 and parse_reset_s("1.5s") == 1.5
    assert parse_reset_s("20ms") == pytest.approx(0.02) and parse_reset_s("2") == 2.0
    assert parse_reset_s(None) == 0.0 and parse_reset_s("soon") == 0.0
    assert rate_signal_of({"content-type": "x"}) is None
    assert rate_signal_of({"x-ratelimit-remaining-requests": "7",
                           "x-ratelimit-reset-requests": "1m30s"}) == RateSignal(
        requests_remaining=7.0, requests_reset_s=90.0)


async def test_every_answers_rate_headers_narrow_the_gate(server: LLMTestServer) -> None:
    """The provider passes each answer's x-ratelimit-* on: a gate configured above the
    server's real limit is narrowed to what the server says is left."""
    limits = ProviderLimits({"deepseek/*": Limit(requests_per_minute=6_000)})
    gate = ProviderGate(limits)
    provider = DeepSeekProvider(Secret("sk-budget"), server.base_url, trust_env=False)
    provider.on_rate_signal = functools.partial(gate.observe, "deepseek")
    config = SessionConfig("deepseek", "deepseek-chat")
    driver = Driver(provider_factory=lambda _p, _m: provider, tools=builtin_registry(),
                    config=config, retry=RetryPolicy(max_attempts=1), gate=gate)
    try:
        for turn in range(3):
            driver.submit(FollowUp(f"narrow-{turn}", "m0", ({"type": "text", "text": "hi"},)))
            await driver.drain()
    finally:
        await provider.aclose()
    budget = gate.budget("deepseek", "deepseek-chat")
    assert budget is not None and budget.requests is not None
    # The server (60 a minute) said 57 were left after the third call: the gate, which
    # thought it had 5,700 a minute, now holds no more than that.
    assert budget.requests.level <= LIMIT_RPM - 3 + 0.5


async def test_a_tenant_flooding_at_ten_times_does_not_starve_the_others() -> None:
    """A budget just spent, then one tenant asks ten times what each of nine others asks,
    all of its calls first: while a call of another tenant waits, the flood is granted about
    once per round, where first come, first served would grant all of its calls first."""
    rpm = 600  # 9.5 grants a second
    flood, others, each = 50, [f"t{n}" for n in range(1, 10)], 5
    server = LLMTestServer(answer, keep_requests=False,
                           limits=RateLimits(requests_per_minute=rpm))
    await server.start()
    gate = ProviderGate(ProviderLimits({"deepseek/*": Limit(requests_per_minute=rpm)}))
    budget = gate.budget("deepseek", "deepseek-chat")
    assert budget is not None and budget.requests is not None
    # The budget has just been overspent: no grant for 2 s, while every call enqueues
    # (a loaded machine takes a while to start 95 sessions' steps).
    budget.requests.level = -20.0
    provider = DeepSeekProvider(Secret("sk-budget"), server.base_url, trust_env=False)
    driver = Driver(provider_factory=lambda _p, _m: provider, tools=builtin_registry(),
                    config=SessionConfig("deepseek", "deepseek-chat"),
                    retry=RetryPolicy(max_attempts=1), gate=gate)
    asked = [(f"flood-{n}", "flood") for n in range(flood)] + [
        (f"{tenant}-{n}", tenant) for tenant in others for n in range(each)]
    try:
        for session, tenant in asked:
            driver.submit(FollowUp(session, "m0", ({"type": "text", "text": "hi"},),
                                   tenant=tenant))
        await driver.drain()
    finally:
        await provider.aclose()
        await server.stop()
    assert isinstance(driver.sink, MemorySink)
    assert server.limits is not None and server.limits.rejected == 0
    logs = driver.sink.events
    assert sum(1 for events in logs.values() for e in events
               if e.type == "assistant/message") == len(asked)
    granted = sorted(_granted_ms(events) for session, events in logs.items()
                     if session.startswith("flood-"))
    # Each other tenant's n-th call, once waiting, sees the flood granted once a round (n
    # rounds at most): first come, first served would grant all 50 of the flood's first.
    for tenant in others:
        mine = sorted((_waited_ms(logs[s]), _granted_ms(logs[s])) for s, t in asked if t == tenant)
        for n, (since, until) in enumerate(mine, start=1):
            overtaken = sum(1 for at in granted if since < at < until)
            # + 3: a grant is stamped when its task resumes, later on a loaded machine
            assert overtaken <= n + 3, (tenant, n, overtaken)


def _waited_ms(events: list[Event]) -> int:
    return next(e.time for e in events if e.type == PROVIDER_WAIT_TYPE)


def _granted_ms(events: list[Event]) -> int:
    """When the call was granted: its grant event (the answer's time if it had none)."""
    return next(e.time for e in events
                if e.type in (PROVIDER_GRANTED_TYPE, "assistant/message"))
