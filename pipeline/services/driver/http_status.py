"""The driver's tiny HTTP status server: ``GET /health`` and ``GET /metrics``.

- ``/health``: 200 with a JSON body while the driver's poll loop is alive, else 503 (a
  liveness probe); the body says whether every assigned partition is built (``ready``) and
  which partitions are owned.
- ``/metrics``: the counters and gauges in the Prometheus text format, named
  ``dsh_driver_<name>`` (counters end in ``_total``), then the text of ``labelled`` (the
  runners' histograms and labelled counters, ``RunnerMetrics.render``) when given.

Plain asyncio streams, HTTP/1.0, one request per connection: enough for probes and a
Prometheus scraper, and no dependency. Nothing secret is ever served (counters only).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Final

GAUGES: Final = frozenset({"partitions_owned", "turns_in_flight", "throttled", "ready"})
MAX_REQUEST_BYTES: Final = 8192
Health = Callable[[], tuple[bool, Mapping[str, object]]]
Snapshot = Callable[[], Mapping[str, int]]
Rendered = Callable[[], str]


def prometheus_text(values: Mapping[str, int], prefix: str = "dsh_driver_") -> str:
    """Counters (``_total``) and gauges in the Prometheus exposition format."""
    lines: list[str] = []
    for name, value in sorted(values.items()):
        kind = "gauge" if name in GAUGES else "counter"
        metric = f"{prefix}{name}" + ("" if kind == "gauge" else "_total")
        lines += [f"# TYPE {metric} {kind}", f"{metric} {int(value)}"]
    return "\n".join(lines) + "\n"


class StatusServer:
    """Serves ``/health`` and ``/metrics`` from two callables; start, then close."""

    def __init__(self, health: Health, snapshot: Snapshot,
                 labelled: Rendered | None = None) -> None:
        self._health = health
        self._snapshot = snapshot
        self._labelled = labelled
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (``port`` 0 picks a free one)."""
        self._server = await asyncio.start_server(self._serve, host, port)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            status, content_type, body = self._answer(head[:MAX_REQUEST_BYTES])
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            status, content_type, body = 400, "text/plain", b"bad request\n"
        writer.write(f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: {content_type}"
                     f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                     + body)
        try:
            await writer.drain()
        finally:
            writer.close()

    def _answer(self, head: bytes) -> tuple[int, str, bytes]:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
            return 405, "text/plain", b"only GET\n"
        path = parts[1].split(b"?", 1)[0]
        if path == b"/health":
            alive, detail = self._health()
            body = json.dumps({"status": "ok" if alive else "down", **detail}).encode()
            return (200 if alive else 503), "application/json", body + b"\n"
        if path == b"/metrics":
            text = prometheus_text(self._snapshot())
            if self._labelled is not None:
                text += self._labelled()
            return 200, "text/plain; version=0.0.4", text.encode()
        return 404, "text/plain", b"not found: try /health or /metrics\n"


_REASONS: Final = {200: "OK", 400: "Bad Request", 404: "Not Found",
                   405: "Method Not Allowed", 503: "Service Unavailable"}
