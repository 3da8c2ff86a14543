"""``dsh-pipeline dashboard``: the live fleet dashboard (web page, JSON + SSE API, /metrics).

Reads the processors' compacted outputs (``fleet``, ``usage``, the active ``derived-messages``
version) and only the live tail of the session topic (never its history; a processors
worker must run, the page says when none does), listens on
``DSH_DASHBOARD_HOST``:``DSH_DASHBOARD_PORT`` (``--host``/``--port`` win) and prints the URL.
With ``DSH_DASHBOARD_TOKEN`` set every request but ``/health`` needs the token (bearer, or the
password of basic auth). With ``DSH_DASHBOARD_PROCESSORS_URL`` (``--processors-url``) a
session page starts from the owning processors worker's tables. Stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import sys
from typing import Any

from pipeline.cli.common import add_listen_options, add_logging_options, configure_logging
from pipeline.codec.avro import EventSerde
from pipeline.services.dashboard.server import serve_until, start_dashboard
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "dashboard", help="serve the live fleet dashboard (web page, JSON/SSE API, /metrics)",
        description="Serve the read-only live dashboard of the fleet, fed by the processors' "
                    "outputs and the live tail of the session topic (run `dsh-pipeline "
                    "processors` too).")
    add_listen_options(parser, what="the dashboard", host_default=None,
                       host_help="interface the dashboard binds to (default: "
                                 "DSH_DASHBOARD_HOST)",
                       port_help="port (default: DSH_DASHBOARD_PORT; 0 picks a free one)")
    parser.add_argument("--processors-url", metavar="URL",
                        help="base URL of the processors workers' HTTP views, e.g. "
                             "http://127.0.0.1:6066: a session page starts from the owning "
                             "worker's tables instead of reading the derived-messages topic "
                             "(default: DSH_DASHBOARD_PROCESSORS_URL; empty: the topic)")
    add_logging_options(parser)
    parser.set_defaults(func=run_dashboard)


def run_dashboard(args: argparse.Namespace, settings: Settings) -> int:
    configure_logging(args)
    if args.processors_url is not None:
        settings = dataclasses.replace(settings, dashboard_processors_url=args.processors_url)
    asyncio.run(_serve(settings, args.host, args.port))
    return 0


async def _serve(settings: Settings, host: str | None, port: int | None) -> None:
    running = await start_dashboard(settings, EventSerde().decode, host=host, port=port)
    protected = " (token required)" if settings.dashboard_token else ""
    print(f"dashboard: {running.url}{protected}", flush=True)
    print(f"dashboard: reading {settings.topics.fleet}, {settings.topics.usage} and the live "
          f"tail of {settings.topics.session_events} at {settings.bootstrap_servers}",
          file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await serve_until(stop, running)
