"""``dsh-pipeline processors``: run one stream-processors worker (faust).

Folds ``<prefix>session-events`` into the derived-messages, usage and fleet tables, publishes
them to their compacted topics and serves them over HTTP on ``--host``:``--port``. Run several
with different ``--port`` values (and ``--data-dir`` with rocksdb) to share the partitions; a
stopped worker's partitions move to the others. The usage records carry the cost ledger,
priced with ``DSH_PRICES`` (docs/costs.md).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pipeline.adapters.kafka.admin import SERVICE_START_RETRY_S, ensure_topics
from pipeline.adapters.loop_probe import wanted as loop_probe_wanted
from pipeline.adapters.registry.client import RegistryClient
from pipeline.adapters.registry.outputs import output_codecs_for_topics
from pipeline.cli.common import (
    add_duration,
    add_listen_options,
    add_logging_options,
    configure_logging,
    port_number,
)
from pipeline.cli.local_store import run_with_trusted_store
from pipeline.cli.provider_config import setting_text
from pipeline.codec.avro import EventSerde
from pipeline.codec.schemas import SchemaTable
from pipeline.core.errors import ConfigError
from pipeline.core.prices import PriceTable, prices_from_text
from pipeline.services.processors.app import build_processors, ensure_internal_topics
from pipeline.services.processors.options import ProcessorsOptions
from pipeline.services.processors.runner import run_worker
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "processors", help="run a stream-processors worker (derived messages, usage, fleet)",
        description=__doc__)
    add_listen_options(parser, what="the HTTP server (tables, /health, /metrics)",
                       host_default="127.0.0.1",
                       port_help="HTTP port (default: DSH_PROCESSORS_WEB_PORT)")
    parser.add_argument("--web-port", type=port_number, dest="port", help=argparse.SUPPRESS)
    parser.add_argument("--web-host", dest="host", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="memory://",
                        help="table store: memory:// (rebuilt from changelogs on start) or "
                             "rocksdb:// (needs rocksdict)")
    parser.add_argument("--data-dir", default=None,
                        help="faust data dir (default <DSH_STATE_DIR>/processors-<port>)")
    parser.add_argument("--standby-replicas", type=int, default=1,
                        help="standby copies of each table partition on other workers")
    add_duration(parser, "--grace", default=5.0,
                 help="how long a usage window stays open after its end for late events")
    add_duration(parser, "--tick", default=1.0, help="time between window-closing ticks")
    parser.add_argument("--windows", default="minute=60,hour=3600",
                        help="usage windows as NAME=SECONDS[,NAME=SECONDS]")
    add_duration(parser, "--session-timeout", default=10.0,
                 help="how long before a dead worker's partitions move to the others")
    add_duration(parser, "--fetch-max-wait", default=0.005, ms=True, dest="fetch_max_wait_ms",
                 help="longest a fetch waits at the broker for new records while records "
                      "arrive (1ms..1500ms; after 0.1s without any, a fetch waits up to "
                      "500ms, answered by the first record)")
    parser.add_argument("--fetch-max-wait-ms", type=int, dest="fetch_max_wait_ms",
                        help=argparse.SUPPRESS)
    parser.add_argument("--fetch-min-bytes", type=int, default=8192,
                        help="the broker answers a fetch once this many bytes are ready "
                             "(1: at once; more: fewer, larger batches, less CPU)")
    parser.add_argument("--registry", action="store_true",
                        help="register the output schemas and write the Confluent framing; "
                             "read session events by registry id too (default: Avro "
                             "single-object encoding, no registry)")
    add_logging_options(parser)
    parser.set_defaults(func=run_processors)


def parse_windows(text: str) -> dict[str, int]:
    """``minute=60,hour=3600`` -> ``{"minute": 60000, "hour": 3600000}``."""
    sizes: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, seconds = part.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if not sep or not name or "/" in name or value <= 0:
            raise ConfigError(f"--windows: {part!r} is not NAME=SECONDS with SECONDS > 0")
        sizes[name] = int(value * 1000)
    if not sizes:
        raise ConfigError("--windows: give at least one NAME=SECONDS")
    return sizes


def run_processors(args: argparse.Namespace, settings: Settings) -> int:
    port = args.port if args.port is not None else settings.processors_web_port
    options = ProcessorsOptions(
        web_port=port, web_host=args.host, store=args.store,
        standby_replicas=args.standby_replicas, grace_ms=int(args.grace * 1000),
        tick_interval_s=args.tick, session_timeout_s=args.session_timeout,
        fetch_max_wait_ms=args.fetch_max_wait_ms, fetch_min_bytes=args.fetch_min_bytes,
        data_dir=args.data_dir or f"{settings.state_dir}/processors-{port}",
        loop_probe=loop_probe_wanted())
    sizes = parse_windows(args.windows)
    prices = prices_of(settings)   # a bad table stops the worker before it starts
    asyncio.run(ensure_topics(settings, retry_for_s=SERVICE_START_RETRY_S))
    asyncio.run(ensure_internal_topics(settings, options, retry_for_s=SERVICE_START_RETRY_S))
    decode, outputs = EventSerde().decode, None
    if args.registry:
        # Open for the worker's lifetime: an unknown schema id is fetched once, then cached.
        client = RegistryClient.from_settings(settings)
        decode = EventSerde(SchemaTable(client.get_schema)).decode
        outputs = output_codecs_for_topics(client, settings.topics)
    processors = build_processors(settings, decode, options, sizes, outputs, prices)
    own_logging = args.log_format == "json"
    if own_logging:
        configure_logging(args)
    return run_with_trusted_store(options.store, options.data_dir, lambda: run_worker(
        processors, loglevel=args.log_level.upper(), own_logging=own_logging))


def prices_of(settings: Settings) -> PriceTable:
    """``DSH_PRICES``: JSON text, or the path of a JSON file (empty: no price at all)."""
    text = setting_text("DSH_PRICES", settings.prices)
    return PriceTable() if text is None else prices_from_text(text)
