"""The dashboard's HTTP API against a real broker and a real processors worker: token,
read-only, JSON, SSE (the session stream's snapshot and resume), /metrics, and /health when
no processors worker runs."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

from dashboard_support import (
    LiveSession,
    SseMessages,
    aget,
    dashboard_settings,
    eventually,
    prepare_topics,
    prometheus_samples,
    publish,
    read_sse,
)
from processors_support import Worker

from pipeline.codec.avro import EventSerde
from pipeline.services.dashboard.server import start_dashboard
from pipeline.services.dashboard.service import DashboardConfig

TOKEN = "t0ken-for-tests"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


async def test_token_read_only_api_streams_and_metrics(kafka_bootstrap: str,
                                                       topic_prefix: str,
                                                       dashboard_worker: Worker) -> None:
    settings = dashboard_settings(kafka_bootstrap, topic_prefix, token=TOKEN)
    await prepare_topics(settings)
    live = LiveSession("web-1")
    live.start_turn("hello")
    await publish(settings, live.session_id, live.take())
    dashboard = await start_dashboard(settings, EventSerde().decode, host="127.0.0.1", port=0,
                                      config=DashboardConfig(lag_interval_s=0.5))
    base = dashboard.url
    try:
        for path in ("", "api/fleet", "metrics", "api/stream/fleet", "static/fleet.js"):
            status, headers, body = await aget(base + path)
            assert status == 401, path
            assert headers["WWW-Authenticate"].startswith("Basic ")
            assert TOKEN not in body
        assert (await aget(base + "api/fleet", {"Authorization": "Bearer nope"}))[0] == 401
        assert (await aget(base + "health"))[0] == 200  # probes need no token
        basic = {"Authorization": "Basic " + base64.b64encode(f"me:{TOKEN}".encode()).decode()}
        assert (await aget(base, basic))[0] == 200

        async def fleet_lists_session() -> Any:
            _, _, body = await aget(base + "api/fleet", BEARER)
            return [r for r in json.loads(body)["sessions"] if r["session_id"] == "web-1"]
        (row,) = await eventually(fleet_lists_session, 120, what="the session in /api/fleet")
        assert (row["state"], row["turn"], row["step"]) == ("in-turn", 1, 1)

        live.finish(live.answer(["hi"]), "hi", {"inputTokens": 7, "outputTokens": 3})
        live.end_turn()
        after_start = live.take()
        await publish(settings, live.session_id, after_start)
        turns = ("dsh_dashboard_turns_ended_total", (("reason", "completed"),))

        async def counted() -> Any:
            after = prometheus_samples((await aget(base + "metrics", BEARER))[2])
            return after if after.get(turns) == 1 else None
        after = await eventually(counted, what="the turn counted in /metrics")
        read = "dsh_dashboard_events_read_total"  # the live tail only, not the history
        assert sum(v for (n, _), v in after.items() if n == read) == len(after_start)

        async def idle() -> Any:
            messages = await read_sse(base + "api/stream/fleet", BEARER, 2)
            return messages if messages[0][1]["sessions"][0]["state"] == "idle" else None
        messages = await eventually(idle, 60, "the session idle on the fleet stream")
        assert [name for name, _ in messages] == ["snapshot", "charts"]
        assert messages[0][1]["sessions"][0]["output_tokens"] == 3

        def caught_up(found: SseMessages) -> bool:
            return any(name == "caught-up" for name, _ in found)
        session = await read_sse(base + "api/stream/sessions/web-1", BEARER, until=caught_up)
        assert session[0][0] == "snapshot"
        at_seq = session[0][1]["atSeq"]
        assert at_seq == next(e.seq for e in after_start if e.type == "assistant/message")
        resumed = await read_sse(base + "api/stream/sessions/web-1",
                                 {**BEARER, "Last-Event-ID": str(at_seq)}, until=caught_up)
        assert [m[1]["seq"] for m in resumed if m[0] == "event"] == [at_seq + 1, at_seq + 2]
        assert all(name != "snapshot" for name, _ in resumed)  # resumed after the seq
        async def worker_seen() -> Any:  # sampled every lag interval; a rebalance shows 0
            health = json.loads((await aget(base + "health"))[2])
            return health if health["processorsWorkers"] >= 1 else None
        health = await eventually(worker_seen, 60, "the processors worker in /health")
        assert health["processorsError"] is None
    finally:
        await dashboard.stop()


async def test_nothing_can_be_written(kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = dashboard_settings(kafka_bootstrap, topic_prefix)
    await prepare_topics(settings)
    dashboard = await start_dashboard(settings, EventSerde().decode, host="127.0.0.1", port=0,
                                      config=DashboardConfig(lag_interval_s=0.5))
    try:
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            status = await asyncio.to_thread(_request, dashboard.url + "api/fleet", method)
            assert status == 405, method
        assert (await aget(dashboard.url + "api/fleet"))[0] == 200  # no token configured
        decision = dashboard.url + "api/sessions/s1/approvals/c1"  # the one POST route
        assert await asyncio.to_thread(_request, decision, "GET") == 405
        assert await asyncio.to_thread(_request, decision, "POST") == 403  # needs a token
        assert (await aget(dashboard.url + "api/sessions/unknown"))[0] == 404

        async def no_processors() -> Any:  # no worker runs in this test: it says so
            health = json.loads((await aget(dashboard.url + "health"))[2])
            return health if health["processorsError"] else None
        health = await eventually(no_processors, 30, "/health saying no processors run")
        assert health["status"] == "degraded" and health["processorsWorkers"] == 0
        assert "dsh-pipeline processors" in health["processorsError"]
        _, _, body = await aget(dashboard.url + "api/fleet")
        assert json.loads(body)["processorsError"] == health["processorsError"]
    finally:
        await dashboard.stop()


def _request(url: str, method: str) -> int:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method=method),
                                    timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
