"""The dashboard's HTTP server (aiohttp): pages, the JSON + SSE API, ``/metrics``, ``/health``.

Read-only but for one route: every route is a GET (HEAD is answered too), except the POST
of a decision on a tool call waiting for approval (:mod:`.decisions`, which needs a token);
any other method gets 405 before routing. When a token is configured every path but
``/health`` needs it, as ``Authorization: Bearer <token>`` or as the password of HTTP basic
auth (any user name; a browser asks once and then sends it with every request, the
EventSource streams included).
The API is described in ``API.md`` beside this module.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware

from pipeline.core.errors import DshError
from pipeline.core.events import JsonValue, dumps_json
from pipeline.core.ledger import HOUR_MS
from pipeline.services.dashboard.decisions import DECISION_PATH, decide, is_decision_path
from pipeline.services.dashboard.service import DashboardService
from pipeline.services.dashboard.session_stream import stream_session
from pipeline.services.dashboard.sse import (
    HEARTBEAT_S,
    frame,
    heartbeat,
    last_event_id,
    open_stream,
)
from pipeline.settings import Secret

STATIC: Final = Path(__file__).with_name("static")
PUBLIC_PATHS: Final = frozenset({"/health"})
SERVICE_KEY: Final = web.AppKey("service", DashboardService)
DAY_MS: Final = 24 * HOUR_MS
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def token_accepted(header: str | None, token: str) -> bool:
    """True when the Authorization header carries ``token`` (bearer, or basic password)."""
    if not header:
        return False
    scheme, _, value = header.strip().partition(" ")
    given = value.strip()
    if scheme.lower() == "basic":
        try:
            given = base64.b64decode(given, validate=True).decode("utf-8").partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return False
    elif scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.encode(), token.encode())


def _guard(token: Secret) -> Middleware:
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        decision = is_decision_path(request.path)
        if request.method not in (("POST",) if decision else ("GET", "HEAD")):
            return web.Response(status=405, text="the dashboard is read-only: GET only (a "
                                "decision on an approval: POST only)\n",
                                headers={"Allow": "POST" if decision else "GET, HEAD"})
        if token and request.path not in PUBLIC_PATHS and not token_accepted(
                request.headers.get("Authorization"), token.reveal()):
            return web.Response(status=401, text="authentication required\n", headers={
                "WWW-Authenticate": 'Basic realm="dsh-pipeline dashboard", charset="UTF-8"'})
        return await handler(request)
    return guard


def _json(body: JsonValue, status: int = 200) -> web.Response:
    return web.Response(text=dumps_json(body), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _page(name: str) -> Handler:
    async def page(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / name, headers={"Cache-Control": "no-cache"})
    return page


def _problems(service: DashboardService) -> dict[str, JsonValue]:
    """What the pages show in their banner: the tail, the outputs, the processors."""
    return {"feedError": service.feed_error, "outputsError": service.outputs_error,
            "processorsError": service.processors_error, "ready": service.ready_s is not None}


async def fleet(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    return _json({"sessions": service.model.snapshot_rows(), **_problems(service)})


async def charts(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    return _json(service.model.charts(service.clock()))


async def usage(request: web.Request) -> web.StreamResponse:
    """Usage and cost by tenant and provider/model: every hour of the ledger, and the hours
    of the last day (docs/costs.md)."""
    service = request.app[SERVICE_KEY]
    day_ago = service.clock() - DAY_MS
    return _json({"tenants": service.model.tenant_usage(),
                  "lastDay": service.model.tenant_usage(day_ago - day_ago % HOUR_MS),
                  **_problems(service)})


async def session_row(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    row = service.model.rows.get(request.match_info["session_id"])
    if row is None:
        return _json({"error": "unknown session"}, 404)
    return _json(row.to_json())


async def fleet_stream(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    subscriber = service.hub.subscribe_fleet()
    try:
        response = await open_stream(request)
        await response.write(frame("snapshot", {"sessions": service.model.snapshot_rows(),
                                                **_problems(service)}))
        await response.write(frame("charts", service.model.charts(service.clock())))
        while True:
            try:
                message = await asyncio.wait_for(subscriber.queue.get(), HEARTBEAT_S)
            except TimeoutError:
                await heartbeat(response)
                continue
            if message[0] == "overflow":
                break
            await response.write(frame(message[0], message[1]))
            if message[0] == "charts":  # once a second: the banner stays current
                await response.write(frame("status", _problems(service)))
    except ConnectionResetError:
        pass  # the client went away: nothing to tell anyone
    finally:
        service.hub.unsubscribe(subscriber)
    return response


async def session_stream(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    session_id = request.match_info["session_id"]
    resume = last_event_id(request)
    response = await open_stream(request)
    try:
        await stream_session(response, service, session_id, resume)
    except DshError as exc:  # e.g. the topic is not there yet: say so, the client retries
        with contextlib.suppress(ConnectionResetError):
            await response.write(frame("stream-error", {"message": str(exc)}))
    except ConnectionResetError:
        pass  # the client went away
    return response


async def metrics(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    service.model.metrics.sse_clients.set(service.hub.clients)
    return web.Response(body=service.model.metrics.render(),
                        content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def health(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    problems = _problems(service)
    ok = problems["ready"] and not any(problems[k] for k in (
        "feedError", "outputsError", "processorsError"))
    return _json({"status": "ok" if ok else "degraded", **problems,
                  "readySeconds": service.ready_s, "events": service.events_read,
                  "sessions": len(service.model.rows),
                  "processorsWorkers": service.processors_workers,
                  "tailStart": {str(p): o for p, o in sorted(service.tail_start.items())},
                  "sessionTopicReads": {"records": service.reads.records, "first": {
                      str(p): o for p, o in sorted(service.reads.first.items())}},
                  "undecodable": service.undecodable,
                  "lastUndecodable": service.problems[-1] if service.problems else None,
                  "problems": list(service.problems)})


def build_app(service: DashboardService, token: Secret) -> web.Application:
    """The aiohttp application; start ``service`` before serving requests."""
    app = web.Application(middlewares=[_guard(token)])
    app[SERVICE_KEY] = service
    routes = [("/", _page("index.html")), ("/sessions/{session_id}", _page("session.html")),
              ("/api/fleet", fleet), ("/api/charts", charts), ("/api/usage", usage),
              ("/api/sessions/{session_id}", session_row),
              ("/api/stream/fleet", fleet_stream),
              ("/api/stream/sessions/{session_id}", session_stream),
              ("/metrics", metrics), ("/health", health)]
    for path, handler in routes:
        app.router.add_get(path, handler)

    async def decision(request: web.Request) -> web.StreamResponse:
        return await decide(request, service.settings, bool(token))
    app.router.add_post(DECISION_PATH, decision)
    app.router.add_static("/static/", STATIC, follow_symlinks=False)
    return app
