"""The driver's /health and /metrics server, over a real local socket."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pipeline.services.driver.http_status import StatusServer, prometheus_text


def fetch(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


async def test_health_and_metrics_answer_from_the_service_state() -> None:
    state = {"alive": True}
    server = StatusServer(lambda: (state["alive"], {"ready": True, "partitions": [0, 2]}),
                          lambda: {"commands": 7, "turns_in_flight": 2, "dead_letters": 1})
    port = await server.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    try:
        status, kind, body = await asyncio.to_thread(fetch, f"{base}/health")
        assert status == 200 and kind == "application/json"
        assert json.loads(body) == {"status": "ok", "ready": True, "partitions": [0, 2]}
        state["alive"] = False
        status, _, body = await asyncio.to_thread(fetch, f"{base}/health")
        assert status == 503 and json.loads(body)["status"] == "down"
        status, kind, body = await asyncio.to_thread(fetch, f"{base}/metrics")
        assert status == 200 and kind.startswith("text/plain")
        assert "dsh_driver_commands_total 7.0\n" in body
        assert "# TYPE dsh_driver_turns_in_flight gauge\ndsh_driver_turns_in_flight 2.0\n" in body
        status, _, _ = await asyncio.to_thread(fetch, f"{base}/nothing")
        assert status == 404
    finally:
        await server.close()


async def test_garbage_request_gets_a_4xx_not_a_crash() -> None:
    server = StatusServer(lambda: (True, {}), dict)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x16\x03\x01 not http at all\r\n\r\n")
        await writer.drain()
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.") and answer[9:10] == b"4"  # a 4xx
        status, _, _ = await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/health")
        assert status == 200  # still serving
    finally:
        await server.close()


def test_prometheus_text_names_counters_and_gauges() -> None:
    text = prometheus_text({"fenced": 1, "ready": 1})
    assert "dsh_driver_fenced_total 1.0\n" in text
    assert "# TYPE dsh_driver_ready gauge\ndsh_driver_ready 1.0\n" in text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families == {"dsh_driver_fenced": "counter", "dsh_driver_ready": "gauge"}
