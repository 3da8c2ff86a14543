"""``dsh-pipeline export``: write a session from the session topic as a dsh JSONL file.

``export SESSION [-o FILE|-] [--from-seq N] [--to-seq M] [--spill-dir DIR]``: the session as a
dsh file (header + events, packed rows), or some of its events, and the full texts of its
spilled tool results. A file that was imported (:mod:`pipeline.cli.cmd_import`) comes back
byte for byte.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from pipeline.cli.common import STDIO, add_session_argument, is_stdio, progress_line
from pipeline.codec.avro import EventSerde
from pipeline.codec.sessionfile import encode_lines, write_session_file
from pipeline.core.errors import ConfigError
from pipeline.services.replay.topic import minimal_header
from pipeline.services.replay.transfer import export_session, export_spilled, read_session
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
    export = subparsers.add_parser(
        "export", help="write a session as a dsh JSONL file",
        description="Write SESSION from the session topic as a dsh session file: its header "
                    "line, then its events, chunk runs packed as dsh packs them. A file that "
                    "was imported comes back byte for byte. --from-seq/--to-seq write only "
                    "those events (for looking at: a file must start at seq 0 to be imported).")
    add_session_argument(export)
    export.add_argument("-o", "--output", default=STDIO, metavar="FILE",
                        help="file to write (.jsonl, or .jsonl.zstd for zstd; - for stdout)")
    export.add_argument("--from-seq", type=int, default=0, metavar="N",
                        help="first event to write")
    export.add_argument("--to-seq", type=int, default=None, metavar="M",
                        help="last event to write (default: the last one)")
    export.add_argument("--unpacked", action="store_true",
                        help="one line per chunk event instead of dsh's packed rows")
    export.add_argument("--spill-dir", metavar="DIR",
                        help="also write the full text of each spilled tool result to "
                             "DIR/<sha256>.txt (docs/large-content.md)")
    export.set_defaults(func=run_export)


def run_export(args: argparse.Namespace, settings: Settings) -> int:
    if args.from_seq < 0 or (args.to_seq is not None and args.to_seq < args.from_seq):
        raise ConfigError("export needs 0 <= --from-seq <= --to-seq")
    whole = args.from_seq == 0 and args.to_seq is None
    if whole and not is_stdio(args.output):
        count = asyncio.run(export_session(settings, args.session, args.output,
                                           EventSerde().decode, packed=not args.unpacked,
                                           spill_dir=args.spill_dir))
    else:
        count = asyncio.run(_export_some(settings, args))
    progress_line(f"exported session {args.session}: {count} events to {args.output}")
    return 0


async def _export_some(settings: Settings, args: argparse.Namespace) -> int:
    """Some of the session's events, or all of them to stdout."""
    session = await read_session(settings, args.session, EventSerde().decode)
    if not session.events:
        raise ConfigError(f"session {args.session!r} has no events on "
                          f"{settings.topics.session_events!r}")
    last = args.to_seq if args.to_seq is not None else session.events[-1].seq
    events = [e for e in session.events if args.from_seq <= e.seq <= last]
    header = session.header or minimal_header(args.session)
    if is_stdio(args.output):
        for line in encode_lines(events, header=header, packed=not args.unpacked):
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
    else:
        write_session_file(args.output, events, header=header, packed=not args.unpacked)
    if args.spill_dir is not None:
        await export_spilled(settings, events, Path(args.spill_dir))
    return len(events)
