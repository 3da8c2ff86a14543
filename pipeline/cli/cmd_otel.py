"""``dsh-pipeline otel``: export every ended turn as OpenTelemetry GenAI traces (OTLP/HTTP).

Reads the session topic in its own consumer group (``<DSH_GROUP_ID_PREFIX>otel``), posts
protobuf to ``DSH_OTLP_ENDPOINT``/v1/traces with the headers of ``DSH_OTLP_HEADERS``
(``name=value,...``; masked by ``config``, never logged), and serves ``/health`` and
``/metrics`` on ``DSH_OTEL_METRICS_PORT``. Stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from typing import Any

from pipeline.adapters.kafka.event_stream import Start
from pipeline.cli.common import (
    add_listen_options,
    add_logging_options,
    configure_logging,
    port_number,
)
from pipeline.codec.avro import EventSerde
from pipeline.core.genai_trace import SEMCONV_OPT_IN, SEMCONV_VERSION
from pipeline.services.otel.run import OtelRun, group_of, serve_otel
from pipeline.services.otel.service import OtelOptions
from pipeline.settings import Settings

_STARTS = {"committed": "COMMITTED", "beginning": "BEGINNING", "end": "END"}


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "otel", help="export turns as OpenTelemetry GenAI traces over OTLP/HTTP",
        description=f"Export every ended turn as one trace (invoke_agent, chat, execute_tool "
                    f"spans; GenAI semantic conventions v{SEMCONV_VERSION}, "
                    f"OTEL_SEMCONV_STABILITY_OPT_IN={SEMCONV_OPT_IN}) to DSH_OTLP_ENDPOINT.")
    parser.add_argument("--with-content", action="store_true",
                        help="add message content, tool arguments and results to the spans "
                             "(off by default: content may be sensitive)")
    parser.add_argument("--group", default=None,
                        help="consumer group (default <DSH_GROUP_ID_PREFIX>otel)")
    parser.add_argument("--start", choices=sorted(_STARTS), default="committed",
                        help="committed (default): the group's committed offsets, the "
                             "beginning for a new group; beginning or end: ignore them "
                             "(e.g. a replay into a new --group)")
    add_listen_options(parser, what="/health and /metrics", host_default="0.0.0.0",
                       port_help="/health and /metrics port (default: DSH_OTEL_METRICS_PORT; "
                                 "0 picks a free one, -1 serves none)")
    parser.add_argument("--metrics-port", type=port_number, dest="port",
                        help=argparse.SUPPRESS)  # the first spelling
    parser.add_argument("--max-spans", type=int, default=512,
                        help="spans per export request")
    add_logging_options(parser, default="info")
    parser.set_defaults(func=run_otel)


def run_otel(args: argparse.Namespace, settings: Settings) -> int:
    configure_logging(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per export request
    run = OtelRun(group_id=args.group or group_of(settings), start=Start[_STARTS[args.start]],
                  metrics_port=args.port, metrics_host=args.host)
    options = OtelOptions(with_content=args.with_content,
                          max_spans_per_request=max(1, args.max_spans))
    asyncio.run(_serve(settings, run, options))
    return 0


async def _serve(settings: Settings, run: OtelRun, options: OtelOptions) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await serve_otel(settings, EventSerde().decode, stop, run=run, options=options)
