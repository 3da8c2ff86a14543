"""The dashboard in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

One dashboard, one page, a real broker and a real processors worker (the fleet comes from
its outputs): the fleet table lists the test's sessions, a state change appended to the topic
shows on screen within 2 s, the session page shows streamed text as chunks arrive and a
streamed tool call once, the charts draw data, and the page's live stream comes back after
the dashboard restarts on the same port. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_support import LiveSession, dashboard_settings, prepare_topics, publish
from processors_support import Worker, free_port, generated_sessions

from pipeline.codec.avro import EventSerde
from pipeline.core.events import Replace
from pipeline.services.dashboard.server import RunningDashboard, start_dashboard
from pipeline.settings import Settings

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
STATE_CHANGE_BUDGET_MS = 2000

playwright_api = pytest.importorskip("playwright.async_api")
pytestmark = [pytest.mark.broker, pytest.mark.browser, pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install -y chromium)")]


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as p:
        browser = await p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS,
                                          headless=True)
        try:
            yield browser
        finally:
            await browser.close()


async def _start(settings: Settings, port: int) -> RunningDashboard:
    return await start_dashboard(settings, EventSerde().decode, host="127.0.0.1", port=port)


async def _state_of(page: Any, session_id: str) -> str:
    value: str = await page.get_attribute(f'tr[data-session="{session_id}"]', "data-state")
    return value


async def test_fleet_page_live_session_page_charts_and_reconnect(
        kafka_bootstrap: str, topic_prefix: str, browser: Any, dashboard_worker: Worker) -> None:
    settings = dashboard_settings(kafka_bootstrap, topic_prefix)
    await prepare_topics(settings)
    now = int(time.time() * 1000)
    fleet = generated_sessions(7, 6, "deepseek", ["chat-1", "reasoner-1"], now - 30_000)
    for session_id, events in fleet.items():
        await publish(settings, session_id, events)
    live = LiveSession("live-session-1")
    live.start_turn("What is Kafka?")
    await publish(settings, live.session_id, live.take())

    await asyncio.to_thread(dashboard_worker.wait_ready)
    port = free_port()
    dashboard = await _start(settings, port)
    try:
        page = await browser.new_page(viewport={"width": 1440, "height": 1100})
        await page.goto(dashboard.url)
        for session_id in [*fleet, live.session_id]:
            await page.wait_for_selector(f'tr[data-session="{session_id}"]', timeout=30_000)
        assert await _state_of(page, live.session_id) == "in-turn"
        row = page.locator(f'tr[data-session="{live.session_id}"] td[data-col="state"]')
        assert await row.inner_text() == "turn 1 · step 1"

        # A state change on the topic shows on screen within 2 s.
        seqs = live.answer(["Kafka ", "is ", "a log."])
        live.finish(seqs, "Kafka is a log.", {"inputTokens": 1200, "outputTokens": 300})
        live.end_turn()
        appended = time.monotonic()
        await publish(settings, live.session_id, live.take())
        await page.wait_for_function(
            f'document.querySelector(\'tr[data-session="{live.session_id}"]\')'
            '.dataset.state === "idle"', timeout=STATE_CHANGE_BUDGET_MS + 2000)
        seen_after_ms = (time.monotonic() - appended) * 1000
        assert seen_after_ms <= STATE_CHANGE_BUDGET_MS, f"state shown after {seen_after_ms:.0f} ms"

        # Charts draw data (tokens, end reasons, latency percentiles). Latencies come from
        # the live tail: a turn that starts and ends after the dashboard did.
        quick = LiveSession("quick-turn")
        quick.start_turn("Quick?")
        quick.finish(quick.answer(["Yes."]), "Yes.", {"inputTokens": 10, "outputTokens": 2})
        quick.end_turn()
        await publish(settings, quick.session_id, quick.take())
        for chart in ("c-tokens", "c-reasons", "c-latency", "c-inflight"):
            await page.wait_for_function(
                f'Number(document.getElementById("{chart}").dataset.points || 0) > 0',
                timeout=10_000)
        # Usage by tenant, from the ledger rows: the default tenant, and no price table, so
        # the cost is unknown (an en dash), never 0.
        usage_row = ('Array.from(document.querySelectorAll("#usage-table tbody tr")).find('
                     '(tr) => tr.innerText.includes("deepseek/chat-1"))')
        await page.wait_for_function(f"!!({usage_row})", timeout=30_000)
        cells = await page.evaluate(f"Array.from(({usage_row}).cells).map((c) => c.innerText)")
        assert cells[0] == "(default)" and cells[7] == "\u2013" and cells[8] != "0", cells
        ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "dashboard-fleet.png"), full_page=True)

        # Search filters the table.
        await page.fill("#search", live.session_id)
        await page.wait_for_function('document.querySelectorAll("#fleet tbody tr").length === 1')
        await page.fill("#search", "")

        await _session_page_streams(settings, browser, dashboard.url, live)

        # The dashboard restarts on the same port: the open page's stream comes back.
        await dashboard.stop()
        await page.wait_for_selector('#conn[data-state="down"]', timeout=10_000)
        late = LiveSession("after-restart")
        late.start_turn("hello again")
        await publish(settings, late.session_id, late.take())
        dashboard = await _start(settings, port)
        await page.wait_for_selector('#conn[data-state="live"]', timeout=15_000)
        await page.wait_for_selector(f'tr[data-session="{late.session_id}"]', timeout=30_000)
        assert await _state_of(page, late.session_id) == "in-turn"
    finally:
        await dashboard.stop()


async def _session_page_streams(settings: Settings, browser: Any, base: str,
                                live: LiveSession) -> None:
    page = await browser.new_page(viewport={"width": 1440, "height": 1000})
    await page.goto(f"{base}sessions/{live.session_id}")
    await page.wait_for_selector("#transcript .msg.user", timeout=30_000)
    await page.wait_for_function(
        'document.getElementById("transcript").innerText.includes("Kafka is a log.")')
    # A new turn streams in: the text appears chunk by chunk, before the message is final.
    live.start_turn("And a topic?")
    seqs = live.answer(["A topic ", "is a named ", "stream of records"])
    await publish(settings, live.session_id, live.take())
    await page.wait_for_function(
        'document.querySelector("#transcript .msg.assistant.streaming")?.innerText'
        '.includes("A topic is a named stream of records")', timeout=10_000)
    await page.wait_for_selector('#state:text("turn 2 · step 1")', timeout=5_000)
    live.finish(seqs, "A topic is a named stream of records.", {"inputTokens": 2000,
                                                                 "outputTokens": 40})
    live.end_turn()
    await publish(settings, live.session_id, live.take())
    await page.wait_for_selector('#state:text("idle")', timeout=5_000)
    assert await page.is_hidden("#derived-pane")  # the derived messages equal the transcript
    # A rewrite of the first question (a replace on the surface): the derived messages now
    # differ, so they appear beside the transcript.
    first = next(e.seq for e in live.events if e.type == "user/message")
    live.add("user/message", {"id": "rewritten", "role": "user", "source": {"kind": "user"},
                              "content": [{"type": "text", "text": "What is Apache Kafka?"}]},
             Replace(first, first), (first,))
    await publish(settings, live.session_id, live.take())
    await page.wait_for_selector("#derived-pane:not([hidden])", timeout=5_000)
    derived = await page.inner_text("#derived")
    assert "What is Apache Kafka?" in derived and "What is Kafka?" not in derived
    await _tool_call_shows_once(settings, page, live)
    await page.screenshot(path=str(ARTIFACTS / "dashboard-session.png"), full_page=False)
    await page.close()


async def _tool_call_shows_once(settings: Settings, page: Any, live: LiveSession) -> None:
    """A tool call streamed in chunks, then final in its message and its ``tool/call`` event:
    one node, rendered the final way."""
    live.start_turn("Run echo")
    call = {"type": "tool-call", "id": "call_3_0", "name": "echo", "arguments": '{"text": "hi"}'}
    seqs = [live.chunk({"type": "block-start", "index": 0, "blockType": "tool-call"}),
            live.chunk({"type": "tool-call-delta", "index": 0, "name": "echo",
                        "argumentsDelta": '{"text": "hi"}'}),
            live.chunk({"type": "block-end", "index": 0, "block": call}),
            live.chunk({"type": "finish", "reason": {"kind": "tool-calls"}})]
    source = {"kind": "model", "provider": live.provider, "model": live.model}
    live.add("assistant/message", {"turn": live.turn, "step": live.step, "usage": {},
                                   "message": {"id": "m-call", "role": "assistant",
                                               "content": [call], "source": source}},
             "append", tuple(seqs))
    live.add("tool/call", {"turn": live.turn, "step": live.step, "callId": "call_3_0",
                           "name": "echo", "arguments": '{"text": "hi"}'})
    await publish(settings, live.session_id, live.take())
    await page.wait_for_selector('#transcript .tool.call[data-call-id="call_3_0"]',
                                 timeout=10_000)
    events = live.events[-1].seq + 1  # the page has handled the tool/call event too
    await page.wait_for_function(
        f'document.getElementById("stats").textContent.startsWith("{events} events")',
        timeout=10_000)
    names = await page.eval_on_selector_all("#transcript .tool.call .name",
                                            "nodes => nodes.map(n => n.textContent)")
    assert names == ["tool call · echo · call_3_0"]
