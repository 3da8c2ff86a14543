"""Pending approvals on the dashboard, in a real headless Chromium (Debian's ``chromium``).

A session whose tool call waits for approval is published to the session topic; a real
processors worker folds it into the fleet output; the dashboard (with a token) lists it under
"Waiting for approval". A person signed in with basic auth types a reason and clicks
Approve: the approve command, naming them and the reason, is on the session's inbox. Without
the token's credentials the decision route answers 401, and a dashboard without a token
refuses decisions (403; ``tests/services/dashboard/test_dashboard_web.py``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from dashboard_support import LiveSession, dashboard_settings, prepare_topics, publish
from processors_support import Worker, free_port
from test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, playwright_api

from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.adapters.kafka.options import client_options
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.core.inbox import Approve, InboxCommand
from pipeline.services.dashboard.server import start_dashboard
from pipeline.settings import Settings

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
TOKEN = "approvals-token"
pytestmark = [pytest.mark.broker, pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install -y chromium)")]


def waiting_session(session_id: str, call_id: str) -> LiveSession:
    """A turn whose ``danger`` call is recorded and asked about, with no decision yet."""
    live = LiveSession(session_id)
    live.start_turn("clean up prod")
    block = {"type": "tool-call", "id": call_id, "name": "danger", "arguments": "{}"}
    seqs = [live.chunk({"type": "block-start", "index": 0, "blockType": "tool-call"}),
            live.chunk({"type": "block-end", "index": 0, "block": block}),
            live.chunk({"type": "finish", "reason": {"kind": "tool-calls"}})]
    live.add("assistant/message", {"turn": 1, "step": 1, "message": {
        "id": "a1", "role": "assistant", "content": [block],
        "source": {"kind": "model", "provider": "deepseek", "model": "chat-1"}}},
        "append", tuple(seqs))
    live.add("tool/call", {"turn": 1, "step": 1, "callId": call_id, "name": "danger",
                           "arguments": "{}"})
    live.add("approval/asked", {"id": "q1", "toolName": "danger", "callId": call_id,
                                "reason": 'tool "danger" matches the approval rule "danger"'})
    return live


async def inbox_commands(settings: Settings, session_id: str) -> list[InboxCommand]:
    consumer = AIOKafkaConsumer(**client_options(settings), enable_auto_commit=False,
                                isolation_level="read_committed")
    await consumer.start()
    try:
        tp = TopicPartition(settings.topics.inbox, partition_for(session_id, 3))
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        batches = await consumer.getmany(tp, timeout_ms=2000)
        return [InboxCodec().decode(r.value) for r in batches.get(tp, [])
                if r.value is not None]
    finally:
        await consumer.stop()


async def test_a_person_approves_a_waiting_call_from_the_fleet_page(
        kafka_bootstrap: str, topic_prefix: str, dashboard_worker: Worker) -> None:
    settings = dashboard_settings(kafka_bootstrap, topic_prefix, token=TOKEN)
    await prepare_topics(settings)
    session_id, call_id = "approval-wait-1", "call-danger-1"
    await publish(settings, session_id, waiting_session(session_id, call_id).take())
    await asyncio.to_thread(dashboard_worker.wait_ready)
    dashboard = await start_dashboard(settings, EventSerde().decode, host="127.0.0.1",
                                      port=free_port())
    try:
        async with playwright_api.async_playwright() as p:
            browser = await p.chromium.launch(executable_path=str(CHROMIUM),
                                              args=CHROMIUM_ARGS, headless=True)
            try:
                await _approve_in_the_browser(browser, dashboard.url, session_id)
            finally:
                await browser.close()
        commands: list[Any] = []
        deadline = time.monotonic() + 30
        while not commands and time.monotonic() < deadline:
            commands = [c for c in await inbox_commands(settings, session_id)
                        if isinstance(c, Approve)]
        assert len(commands) == 1
        approve = commands[0]
        assert approve.kind == "approve" and approve.call_id == call_id
        assert approve.reason == "checked the target"
        assert approve.source == {"kind": "user", "name": "alice", "via": "dashboard"}
    finally:
        await dashboard.stop()


async def _approve_in_the_browser(browser: Any, url: str, session_id: str) -> None:
    anonymous = await browser.new_page()
    response = await anonymous.request.post(
        f"{url}api/sessions/{session_id}/approvals/x", data={"decision": "approve"})
    assert response.status == 401  # the token guards the decision route too
    context = await browser.new_context(
        viewport={"width": 1440, "height": 1000},
        http_credentials={"username": "alice", "password": TOKEN})
    page = await context.new_page()
    await page.goto(url)
    row = f'tr[data-approval="{session_id}"]'
    await page.wait_for_selector(row, timeout=30_000)
    state = page.locator(f'tr[data-session="{session_id}"] td[data-col="state"]')
    assert "waits for approval" in await state.inner_text()
    assert await page.locator(f"{row} td").nth(1).inner_text() == "danger"
    await page.fill(f"{row} input.reason-input", "checked the target")
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "dashboard-approvals.png"))
    await page.click(f"{row} button.approve")
    await page.wait_for_function(
        "s => document.querySelector(s)?.textContent === 'approve sent'",
        arg=f"{row} span[data-outcome]", timeout=15_000)
