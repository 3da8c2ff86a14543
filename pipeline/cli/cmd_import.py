"""``dsh-pipeline import``: publish dsh session files to the session topic (idempotent).

``import FILE... [--batch N]``: many files per transaction; a file with a different event at a
seq the topic holds is refused; one JSON line per file. ``ship`` (:mod:`pipeline.cli.cmd_ship`)
follows a directory instead.

The module is named ``cmd_import`` like every ``cmd_<command>`` module: ``import`` alone is a
Python keyword (a module ``import.py`` could not be imported by name), but with the prefix
``cmd_import`` is an ordinary identifier (``from pipeline.cli import cmd_import`` works), so no
other spelling is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.cli.common import TerminalProgress
from pipeline.codec.avro import EventSerde
from pipeline.core.errors import ConfigError
from pipeline.services.replay.prepare import avro_encoder, default_workers
from pipeline.services.replay.transfer import Importer
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
    imp = subparsers.add_parser(
        "import", help="publish dsh session files (idempotent)",
        description="Validate each FILE, then publish the events the topic does not hold yet, "
                    "one transaction per file (all or nothing). A file with a different event "
                    "at a seq the topic holds is refused. One JSON line per file.")
    imp.add_argument("files", nargs="+", metavar="FILE", help="dsh session files")
    imp.add_argument("--session-id", help="session id to use (one file only; default: the "
                                          "header's id)")
    imp.add_argument("--batch", type=int, default=20_000,
                     help="events per transaction (many files each)")
    imp.set_defaults(func=run_import)


def run_import(args: argparse.Namespace, settings: Settings) -> int:
    if args.session_id and len(args.files) > 1:
        raise ConfigError("--session-id names the session of one file; give one FILE")
    if args.batch < 1:
        raise ConfigError("--batch must be at least 1 event")
    return asyncio.run(_import(settings, args.files, args.session_id, args.batch))


async def _import(settings: Settings, files: list[str], session_id: str | None,
                  batch: int) -> int:
    await ensure_topics(settings)
    serde = EventSerde()
    progress = TerminalProgress() if sys.stderr.isatty() else None
    async with Importer(settings, serde.encode, serde.decode, progress=progress,
                        batch_events=batch, workers=default_workers(),
                        make_encoder=avro_encoder) as importer:
        async for result in importer.import_files(files, session_id=session_id):
            if progress is not None:
                progress.clear()
            print(json.dumps({"file": result.path, "session": result.session_id,
                              "events": result.events, "published": result.published,
                              "already_on_topic": result.already_on_topic}), flush=True)
    if progress is not None:
        progress.done()
    return 0
