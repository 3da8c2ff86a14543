"""Run the dashboard: the service's loops plus the web server, until told to stop."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

from aiohttp import web

from pipeline.adapters.kafka.event_stream import Decoder
from pipeline.adapters.processors_web import ProcessorsWeb
from pipeline.core.errors import ConfigError
from pipeline.services.dashboard.service import DashboardConfig, DashboardService
from pipeline.services.dashboard.web import build_app
from pipeline.settings import Settings


@dataclass(slots=True)
class RunningDashboard:
    """A started dashboard: its URL, and how to stop it."""

    service: DashboardService
    runner: web.AppRunner
    url: str

    async def stop(self) -> None:
        await self.runner.cleanup()  # closes open streams first
        await self.service.stop()


async def start_dashboard(settings: Settings, decode: Decoder, *, host: str | None = None,
                          port: int | None = None,
                          config: DashboardConfig | None = None) -> RunningDashboard:
    """Start the loops and listen on ``host:port`` (port 0: a free one, see ``url``)."""
    tls = _tls_context(settings)
    service = DashboardService(settings, decode, config)
    if settings.dashboard_processors_url:
        service.processors_web = ProcessorsWeb(settings.dashboard_processors_url)
    app = build_app(service, settings.dashboard_token)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    bind_host = host or settings.dashboard_host
    bind_port = settings.dashboard_port if port is None else port
    site = web.TCPSite(runner, bind_host, bind_port, reuse_address=True, ssl_context=tls)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"dashboard cannot listen on {bind_host}:{bind_port}: "
                          f"{exc.strerror or exc}") from None
    await service.start()
    bound = runner.addresses[0][1] if runner.addresses else bind_port
    shown = "127.0.0.1" if bind_host in ("0.0.0.0", "") else bind_host
    scheme = "https" if tls else "http"
    return RunningDashboard(service, runner, f"{scheme}://{shown}:{bound}/")


def _tls_context(settings: Settings) -> ssl.SSLContext | None:
    """HTTPS only when a certificate is given (no plain listener then: a plain HTTP request
    fails its TLS handshake)."""
    if not settings.dashboard_tls_cert:
        return None
    if not settings.dashboard_tls_key:
        raise ConfigError("DSH_DASHBOARD_TLS_CERT needs DSH_DASHBOARD_TLS_KEY")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(settings.dashboard_tls_cert, settings.dashboard_tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"dashboard TLS certificate {settings.dashboard_tls_cert!r} cannot "
                          f"be used: {exc}") from None
    return context


async def serve_until(stop: asyncio.Event, running: RunningDashboard) -> None:
    try:
        await stop.wait()
    finally:
        await running.stop()
