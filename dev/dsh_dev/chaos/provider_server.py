"""A local HTTP server speaking the OpenAI/DeepSeek streaming ``/chat/completions`` protocol.

Responses are scripted (:class:`ScriptedResponse`, queued with :meth:`LLMTestServer.enqueue`):
SSE ``data: {...}`` events, ``data: [DONE]``, error statuses with JSON bodies and headers,
rate limits enforced as a provider does (:class:`RateLimits`: ``429`` + ``Retry-After``),
pauses between events, a connection torn mid-body, a stream that stops sending (for good, or
for ``hang_s`` seconds and then torn). When the queue is empty a ``responder`` (a callable
from the request's JSON body to a response) answers, e.g. the chaos campaign's generated
answers with provider faults (:mod:`dsh_dev.chaos.answers`). The server records every
request it received (headers and JSON body; ``keep_requests=False`` for long runs), the usage
it reported (:attr:`LLMTestServer.reported`: each chunk with a ``usage`` it wrote to a client),
and notices when a client hung up mid-stream.

It runs in the caller's event loop on a free loopback port (aiohttp), so providers are
exercised through a real socket and a real HTTP stack: nothing is patched. The tests use it
through ``tests/support/llm_server.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

SSEEvent = dict[str, Any] | str
"""A dict is sent as ``data: <json>``; a str is written to the body exactly as given."""


def chat_chunk(*, content: str | None = None, reasoning: str | None = None,
               tool_calls: list[dict[str, Any]] | None = None,
               finish_reason: str | None = None, usage: dict[str, Any] | None = None,
               no_choices: bool = False, completion_id: str = "chatcmpl-test"
               ) -> dict[str, Any]:
    """One ``chat.completion.chunk`` as DeepSeek/OpenAI stream it (``completion_id``: the
    ``id`` every chunk of one completion shares)."""
    delta: dict[str, Any] = {}
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    chunk: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk",
                             "created": 1_700_000_000, "model": "deepseek-chat"}
    chunk["choices"] = [] if no_choices else [
        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def tool_call_part(index: int, *, call_id: str | None = None, name: str | None = None,
                   arguments: str = "") -> dict[str, Any]:
    """One entry of ``delta.tool_calls`` (id/name only on a call's first part)."""
    part: dict[str, Any] = {"index": index}
    if call_id is not None:
        part["id"] = call_id
        part["type"] = "function"
    function: dict[str, Any] = {"arguments": arguments}
    if name is not None:
        function["name"] = name
    part["function"] = function
    return part


@dataclass
class ScriptedResponse:
    """What the server answers to one request."""

    status: int = 200
    events: list[SSEEvent] = field(default_factory=list)
    done: bool = True  # end with ``data: [DONE]``
    body: str | None = None  # a non-stream body (error answers)
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "text/event-stream"
    pause_s: float = 0.0  # between events
    cut_after: int | None = None  # tear the connection down after this many events
    hang_after: int | None = None  # stop sending (keep the connection) after this many
    hang_s: float | None = None  # with hang_after: stall this long, then tear (None: for good)
    echo_authorization: bool = False  # put the request's Authorization header in ``body``


@dataclass
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass(frozen=True)
class ReportedUsage:
    """The ``usage`` of a chunk the server wrote to its client, with the chunk's ``id``."""

    completion_id: str
    usage: dict[str, Any]


def error_body(message: str, type_: str = "invalid_request_error") -> str:
    return json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": None}})


Responder = Callable[[Any], ScriptedResponse]
"""Answers a request (its JSON body) when nothing is scripted."""


@dataclass
class RateLimits:
    """Requests and input tokens per minute the server allows, enforced as providers
    describe theirs (a limit of N a minute replenishes continuously, N/60 a second, up to N)
    and refused as they refuse: ``429`` with ``Retry-After`` and the ``x-ratelimit-*``
    headers. A request's tokens are its body's size / 4 (what providers estimate first)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    rejected: int = 0
    accepted: int = 0
    _levels: dict[str, float] = field(default_factory=dict)
    _at: float | None = None

    def admit(self, tokens: int, now: float) -> tuple[bool, dict[str, str]]:
        """Whether the request is allowed (then it is counted), and the ``x-ratelimit-*``
        headers of the answer (a refusal's with ``Retry-After``)."""
        limits = {"requests": (self.requests_per_minute, 1),
                  "tokens": (self.tokens_per_minute, tokens)}
        for kind, (limit, _) in limits.items():
            if limit is not None:
                elapsed = 0.0 if self._at is None else now - self._at
                self._levels[kind] = min(float(limit), self._levels.get(kind, float(limit))
                                         + elapsed * limit / 60.0)
        self._at = now
        short = {kind: need - self._levels[kind] for kind, (limit, need) in limits.items()
                 if limit is not None and self._levels[kind] < need}
        headers: dict[str, str] = {}
        if not short:
            for kind, (limit, need) in limits.items():
                if limit is not None:
                    self._levels[kind] -= need
            self.accepted += 1
        else:
            self.rejected += 1
            wait = max(missing * 60.0 / float(limits[kind][0] or 1)
                       for kind, missing in short.items())
            headers["Retry-After"] = str(max(1, int(wait + 0.999)))
        for kind, (limit, _) in limits.items():
            if limit is not None:
                headers[f"x-ratelimit-remaining-{kind}"] = str(int(self._levels[kind]))
                full_s = (limit - self._levels[kind]) * 60.0 / limit
                headers[f"x-ratelimit-reset-{kind}"] = f"{full_s:.3f}s"
        return not short, headers


class LLMTestServer:
    """Start with ``await server.start()``; ``server.base_url`` is then ``http://127.0.0.1:P``."""

    def __init__(self, responder: Responder | None = None, *, keep_requests: bool = True,
                 port: int = 0, limits: RateLimits | None = None) -> None:
        self.limits = limits
        self.responses: deque[ScriptedResponse] = deque()
        self.requests: list[RecordedRequest] = []
        self.request_count = 0
        # every usage chunk written to a client, in order (a torn stream's is not)
        self.reported: list[ReportedUsage] = []
        self.responder = responder
        self._keep_requests = keep_requests
        self._port = port
        self.client_gone = asyncio.Event()
        self._stopping = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                   shutdown_timeout=1.0)
        self.base_url = ""

    def enqueue(self, *responses: ScriptedResponse) -> None:
        self.responses.extend(responses)

    async def start(self) -> str:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}"
        return self.base_url

    async def stop(self) -> None:
        self._stopping.set()
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.request_count += 1
        if self._keep_requests:
            self.requests.append(RecordedRequest(request.path, dict(request.headers), body))
        limited: dict[str, str] = {}
        if self.limits is not None:
            allowed, limited = self.limits.admit(max(1, len(raw) // 4), time.monotonic())
            if not allowed:
                return web.Response(status=429, headers=limited, content_type="application/json",
                                    text=error_body("Rate limit reached for requests",
                                                    "rate_limit_error"))
        if self.responses:
            scripted = self.responses.popleft()
        elif self.responder is not None:
            scripted = self.responder(body)
        else:
            return web.Response(status=500, text=error_body("test server: nothing scripted"),
                                content_type="application/json")
        if limited:
            scripted = dataclasses.replace(scripted, headers={**limited, **scripted.headers})
        if scripted.body is not None or scripted.status != 200:
            body = scripted.body or ""
            if scripted.echo_authorization:
                body = error_body(f"invalid credentials: {request.headers.get('Authorization')}",
                                  "authentication_error")
            return web.Response(status=scripted.status, text=body, headers=scripted.headers,
                                content_type="application/json")
        return await self._stream(request, scripted)

    async def _stream(self, request: web.Request,
                      scripted: ScriptedResponse) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={
            "Content-Type": scripted.content_type, "Cache-Control": "no-cache",
            **scripted.headers})
        await response.prepare(request)
        events: list[SSEEvent] = list(scripted.events)
        if scripted.done:
            events.append("data: [DONE]\n\n")
        try:
            for position, event in enumerate(events):
                if position == scripted.cut_after:
                    assert request.transport is not None
                    request.transport.abort()  # torn mid-body: no final chunk terminator
                    return response
                if position == scripted.hang_after:
                    await self._hang(scripted.hang_s)
                    if request.transport is not None:
                        request.transport.abort()  # stalled, then torn
                    return response
                if position and scripted.pause_s:
                    await asyncio.sleep(scripted.pause_s)
                text = event if isinstance(event, str) else f"data: {json.dumps(event)}\n\n"
                await response.write(text.encode())
                if isinstance(event, dict) and isinstance(event.get("usage"), dict):
                    self.reported.append(ReportedUsage(str(event.get("id", "")),
                                                       event["usage"]))
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            self.client_gone.set()  # the client closed the stream before its end
        return response

    async def _hang(self, seconds: float | None) -> None:
        """Until the server stops, or ``seconds`` (whichever comes first)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
