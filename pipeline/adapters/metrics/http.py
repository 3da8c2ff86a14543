"""``GET /health`` and ``GET /metrics`` of a service, served by aiohttp.

- ``/health``: 200 and a JSON body while the service says it is alive, else 503;
- ``/metrics``: ``prometheus_client``'s exposition of a registry (text format 0.0.4), then
  any extra text the service renders itself.

Nothing secret is ever served: counters, gauges and histograms only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Health = Callable[[], tuple[bool, Mapping[str, object]]]


class StatusHttpServer:
    """Serves ``/health`` and ``/metrics``; :meth:`start` then :meth:`close`."""

    def __init__(self, health: Health, registry: CollectorRegistry,
                 extra: Callable[[], str] | None = None) -> None:
        self._health = health
        self._registry = registry
        self._extra = extra
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (``port`` 0 picks a free one)."""
        app = web.Application()
        app.router.add_get("/health", self._serve_health)
        app.router.add_get("/metrics", self._serve_metrics)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        server = site._server
        sockets = getattr(server, "sockets", None) or ()
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _serve_health(self, _request: web.Request) -> web.Response:
        alive, detail = self._health()
        body = json.dumps({"status": "ok" if alive else "down", **detail}) + "\n"
        return web.Response(status=200 if alive else 503, body=body.encode("utf-8"),
                            headers={"Content-Type": "application/json"})

    async def _serve_metrics(self, _request: web.Request) -> web.Response:
        text = generate_latest(self._registry).decode("utf-8")
        if self._extra is not None:
            text += self._extra()
        return web.Response(body=text.encode("utf-8"),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})
