"""A real OTLP/HTTP trace receiver for tests: aiohttp on a local port, requests decoded with
``opentelemetry-proto``; it can answer 503 for a while, or 400 to chosen sessions."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def attributes(span: Span) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = tuple(v.string_value for v in kv.value.array_value.values)
        else:
            out[kv.key] = getattr(kv.value, kind)
    return out


@dataclass
class OtlpReceiver:
    unavailable_for: int = 0  # answer 503 to this many requests first
    refuse: Callable[[list[Span]], bool] = lambda _spans: False  # refuse when true
    refuse_status: int = 400
    requests: int = 0
    refused: int = 0
    spans: list[Span] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None
    port: int = 0

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.headers_seen.append(dict(request.headers))
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415)
        if self.unavailable_for > 0:
            self.unavailable_for -= 1
            return web.Response(status=503, headers={"Retry-After": "0"})
        decoded = ExportTraceServiceRequest()
        decoded.ParseFromString(await request.read())
        spans = [s for rs in decoded.resource_spans for ss in rs.scope_spans for s in ss.spans]
        if self.refuse(spans):
            self.refused += 1
            return web.Response(status=self.refuse_status, text="bad span data")
        self.spans.extend(spans)
        self.arrived.set()
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def by_name(self, prefix: str) -> list[Span]:
        return [s for s in self.spans if s.name.startswith(prefix)]

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
        async def until() -> None:
            while not predicate():
                self.arrived.clear()
                await self.arrived.wait()
        await asyncio.wait_for(until(), timeout_s)
