"""``dsh-pipeline ship``: publish a directory tree of dsh session files, exactly once.

``ship DIR [--follow]``: every ``*.jsonl`` / ``*.jsonl.zstd`` under DIR is published exactly
once across restarts (the topic is the checkpoint); with ``--follow`` what is appended is
published too. One JSON summary line; exit 1 if a file had a problem.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.cli.common import (
    TerminalProgress,
    add_duration,
    add_logging_options,
    configure_logging,
    progress_line,
)
from pipeline.codec.avro import EventSerde
from pipeline.services.replay.ship import Shipper
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
    ship = subparsers.add_parser(
        "ship", help="follow a directory of dsh session files",
        description="Publish every *.jsonl / *.jsonl.zstd under DIR exactly once across "
                    "restarts (the topic is the checkpoint); with --follow, keep publishing "
                    "what is appended. Exit 1 if a file had a problem.")
    ship.add_argument("directory", metavar="DIR", help="the folder to publish")
    ship.add_argument("--follow", action="store_true", help="keep following (Ctrl-C stops)")
    add_duration(ship, "--interval", default=1.0, help="time between passes")
    ship.add_argument("--batch", type=int, default=5000, help="events per transaction")
    add_logging_options(ship)
    ship.set_defaults(func=run_ship)


def run_ship(args: argparse.Namespace, settings: Settings) -> int:
    configure_logging(args)
    return asyncio.run(_ship(settings, args))


async def _ship(settings: Settings, args: argparse.Namespace) -> int:
    await ensure_topics(settings)
    live = TerminalProgress() if sys.stderr.isatty() else None
    async with Shipper(settings, args.directory, EventSerde().encode, batch=args.batch,
                       progress=progress_line, live=live) as shipper:
        stats = await shipper.run(follow=args.follow, interval_s=args.interval)
    print(json.dumps({"files": stats.files, "sessions": stats.sessions,
                      "published": stats.published, "problems": len(stats.problems)}))
    return 1 if stats.problems else 0
