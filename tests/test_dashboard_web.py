"""The dashboard's HTTP API against a real broker: token, read-only, JSON, SSE, /metrics."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

from dashboard_support import (
    LiveSession,
    aget,
    dashboard_settings,
    eventually,
    prepare_topics,
    prometheus_samples,
    publish,
)

from pipeline.codec.avro import EventSerde
from pipeline.services.dashboard.server import start_dashboard
from pipeline.services.dashboard.service import DashboardConfig

TOKEN = "t0ken-for-tests"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


async def _read_sse(url: str, headers: dict[str, str], wanted: int) -> list[tuple[str, Any]]:
    """The first ``wanted`` SSE messages of a stream, read over a raw socket."""
    host, _, rest = url.removeprefix("http://").partition("/")
    name, port = host.split(":")
    reader, writer = await asyncio.open_connection(name, int(port))
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"GET /{rest} HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode())
    await writer.drain()
    messages: list[tuple[str, Any]] = []
    event = ""
    try:
        while len(messages) < wanted:
            line = (await asyncio.wait_for(reader.readline(), 20)).decode().rstrip("\r\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                messages.append((event, json.loads(line[6:])))
    finally:
        writer.close()
    return messages


async def test_token_read_only_api_streams_and_metrics(kafka_bootstrap: str,
                                                       topic_prefix: str) -> None:
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
        (row,) = await eventually(fleet_lists_session, what="the session in /api/fleet")
        assert (row["state"], row["turn"], row["step"]) == ("in-turn", 1, 1)

        before = prometheus_samples((await aget(base + "metrics", BEARER))[2])
        live.finish(live.answer(["hi"]), "hi", {"inputTokens": 7, "outputTokens": 3})
        live.end_turn()
        await publish(settings, live.session_id, live.take())
        turns = ("dsh_dashboard_turns_ended_total", (("reason", "completed"),))

        async def counted() -> Any:
            after = prometheus_samples((await aget(base + "metrics", BEARER))[2])
            return after if after.get(turns) == 1 else None
        after = await eventually(counted, what="the turn counted in /metrics")
        read = "dsh_dashboard_events_read_total"
        assert sum(v for (n, _), v in after.items() if n == read) == len(live.events)
        assert sum(v for (n, _), v in before.items() if n == read) < len(live.events)

        messages = await _read_sse(base + "api/stream/fleet", BEARER, 2)
        assert [name for name, _ in messages] == ["snapshot", "charts"]
        assert messages[0][1]["sessions"][0]["state"] == "idle"
        session_messages = await _read_sse(base + "api/stream/sessions/web-1",
                                           {**BEARER, "Last-Event-ID": "3"}, 3)
        assert [m[1]["seq"] for m in session_messages] == [4, 5, 6]  # resumed after seq 3
    finally:
        await dashboard.stop()


async def test_nothing_can_be_written(kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = dashboard_settings(kafka_bootstrap, topic_prefix)
    await prepare_topics(settings)
    dashboard = await start_dashboard(settings, EventSerde().decode, host="127.0.0.1", port=0)
    try:
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            status = await asyncio.to_thread(_request, dashboard.url + "api/fleet", method)
            assert status == 405, method
        assert (await aget(dashboard.url + "api/fleet"))[0] == 200  # no token configured
        assert (await aget(dashboard.url + "api/sessions/unknown"))[0] == 404
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
