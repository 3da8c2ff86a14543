"""Fan-out and replay commands: ``export``, ``import``, ``ship``, ``replay``, ``check``
(``tail``: :mod:`pipeline.cli.cmd_tail`).

- ``export SESSION [-o FILE|-] [--from-seq N] [--to-seq M] [--spill-dir DIR]``: the session
  as a dsh file (header + events, packed rows), or some of its events, and the full texts of
  its spilled tool results;
- ``import FILE... [--batch N]``: idempotent, many files per transaction; a conflicting file
  is refused;
- ``ship DIR [--follow]``: publish a directory tree of dsh session files, exactly once;
- ``replay``: rebuild derived-messages into a new version, verify, hand it over from the
  live processors (they hold while it catches up, then publish into it), switch readers;
  ``replay --withdraw-handover`` clears the handover of a replay that died holding them;
  ``replay SESSION [--jsonl|--transcript]`` prints one session from the topic;
- ``check [SESSION...]``: fsck of the session topic, JSON summary, exit 1 on any problem.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.registry.client import RegistryClient
from pipeline.adapters.registry.outputs import output_codecs_for_topics, registry_lookup
from pipeline.cli.common import (
    STDIO,
    add_duration,
    add_logging_options,
    add_session_argument,
    configure_logging,
    is_stdio,
)
from pipeline.codec.avro import EventSerde
from pipeline.codec.outputs import DerivedChangeSerde
from pipeline.codec.schemas import SchemaTable
from pipeline.codec.sessionfile import encode_lines, write_session_file
from pipeline.core.errors import ConfigError
from pipeline.services.processors.verify import verify_processors
from pipeline.services.replay.check import CheckSummary, check_topic
from pipeline.services.replay.prepare import avro_encoder, default_workers
from pipeline.services.replay.rebuild import replay_projection
from pipeline.services.replay.render import transcript
from pipeline.services.replay.ship import Shipper
from pipeline.services.replay.topic import minimal_header
from pipeline.services.replay.transfer import (
    Importer,
    export_session,
    export_spilled,
    read_session,
)
from pipeline.services.replay.versions import HANDOVER_TIMEOUT_S, withdraw_handover
from pipeline.settings import Settings

_MAX_LISTED = 200  # differences printed one per line; the rest counted


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

    _register_replay_and_check(subparsers)


def _register_replay_and_check(subparsers: Any) -> None:
    replay = subparsers.add_parser(
        "replay", help="rebuild derived messages into a new version (or print one session)",
        description="Without SESSION: rebuild derived-messages from offset 0 into a new "
                    "version, verify it against the active one, hand over from the live "
                    "processors and switch readers (exit 1 when it did not switch). With "
                    "SESSION: print that session from the topic.")
    add_session_argument(replay, optional=True,
                         help="print this session (a transcript, or --jsonl) instead")
    replay.add_argument("--session", dest="session_option", help=argparse.SUPPRESS)
    form = replay.add_mutually_exclusive_group()
    form.add_argument("--jsonl", action="store_true", help="print the session as dsh JSONL")
    form.add_argument("--transcript", action="store_true",
                      help="print a readable transcript (the default with --session)")
    replay.add_argument("--force", action="store_true",
                        help="switch readers to the new version even if it differs")
    add_duration(replay, "--handover-timeout", default=HANDOVER_TIMEOUT_S,
                 help="how long to wait for the live processors to hold; on a timeout "
                      "nothing switches")
    replay.add_argument("--withdraw-handover", action="store_true",
                        help="withdraw the pending handover of a replay that is no longer "
                             "running (the live processors hold until then) and exit")
    replay.add_argument("--registry", action="store_true",
                        help="write the new version Confluent-framed (dsh.DerivedMessageChange "
                             "registered under <prefix>derived-messages-value, the subject "
                             "every version shares) and read registry-framed events (default: "
                             "single-object encoding, no registry)")
    replay.set_defaults(func=run_replay)

    check = subparsers.add_parser(
        "check", help="fsck of the session topic (JSON summary)",
        description="Check the session topic: seqs contiguous from 0, every event valid, no "
                    "open turn older than --open-turn-max-age, every tool call of a finished "
                    "turn answered, undecodable records. Prints a JSON summary; exit 1 on any "
                    "problem.")
    add_session_argument(check, many=True, help="only these sessions (default: all)")
    add_duration(check, "--open-turn-max-age", default=3600.0, ms=True,
                 help="an open turn older than this is a problem")
    check.add_argument("--processors", metavar="URL",
                       help="also compare a processors worker's derived tables with the log")
    check.set_defaults(func=run_check)


def _progress(line: str) -> None:
    clear = "\r\x1b[K" if sys.stderr.isatty() else ""  # over a live progress line
    print(f"{clear}{line}", file=sys.stderr, flush=True)


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
    _progress(f"exported session {args.session}: {count} events to {args.output}")
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


class TerminalProgress:
    """One progress line on a terminal's stderr, rewritten in place."""

    def __init__(self) -> None:
        self.line = ""

    def __call__(self, line: str) -> None:
        self.line = line
        sys.stderr.write(f"\r\x1b[K{line}")
        sys.stderr.flush()

    def clear(self) -> None:
        sys.stderr.write("\r\x1b[K")

    def done(self) -> None:
        if self.line:
            sys.stderr.write(f"\r\x1b[K{self.line}\n")
            sys.stderr.flush()


def run_ship(args: argparse.Namespace, settings: Settings) -> int:
    configure_logging(args)
    return asyncio.run(_ship(settings, args))


async def _ship(settings: Settings, args: argparse.Namespace) -> int:
    await ensure_topics(settings)
    live = TerminalProgress() if sys.stderr.isatty() else None
    async with Shipper(settings, args.directory, EventSerde().encode, batch=args.batch,
                       progress=_progress, live=live) as shipper:
        stats = await shipper.run(follow=args.follow, interval_s=args.interval)
    print(json.dumps({"files": stats.files, "sessions": stats.sessions,
                      "published": stats.published, "problems": len(stats.problems)}))
    return 1 if stats.problems else 0


def run_replay(args: argparse.Namespace, settings: Settings) -> int:
    session = args.session or args.session_option
    if session:
        return asyncio.run(_print_session(settings, session, jsonl=args.jsonl))
    if args.jsonl or args.transcript:
        raise ConfigError("--jsonl and --transcript print one session: give a SESSION")
    if args.withdraw_handover:
        return asyncio.run(_withdraw_handover(settings))
    if args.handover_timeout <= 0:
        raise ConfigError(f"--handover-timeout must be positive, got {args.handover_timeout}")
    return asyncio.run(_replay(settings, force=args.force, timeout_s=args.handover_timeout,
                               registry=args.registry))


async def _withdraw_handover(settings: Settings) -> int:
    withdrawn = await withdraw_handover(settings, None)
    if withdrawn is None:
        _progress("no handover is pending: nothing withdrawn")
    else:
        _progress(f"withdrew the handover to version {withdrawn.version} ({withdrawn.topic}, "
                  f"request {withdrawn.request}): the processors resume on the active version")
    return 0


async def _print_session(settings: Settings, session_id: str, *, jsonl: bool) -> int:
    session = await read_session(settings, session_id, EventSerde().decode)
    if not session.events:
        raise ConfigError(f"session {session_id!r} has no events on "
                          f"{settings.topics.session_events!r}")
    lines = (line + "\n" for line in session.lines(session_id)) if jsonl else \
        transcript(session_id, session.events)
    for text in lines:
        sys.stdout.write(text)
    sys.stdout.flush()
    return 0


def _replay_codecs(settings: Settings, registry: bool
                   ) -> tuple[EventSerde, DerivedChangeSerde | None]:
    """Session-event decoder and version encoder: registry-backed with ``--registry``."""
    if not registry:
        return EventSerde(), None
    with RegistryClient.from_settings(settings) as client:
        encoder = output_codecs_for_topics(client, settings.topics).derived
    return EventSerde(SchemaTable(registry_lookup(settings))), encoder


async def _replay(settings: Settings, *, force: bool, timeout_s: float,
                  registry: bool = False) -> int:
    serde, encoder = await asyncio.to_thread(_replay_codecs, settings, registry)
    outcome = await replay_projection(settings, serde.decode, force=force,
                                      progress=_progress, handover_timeout_s=timeout_s,
                                      encoder=encoder)
    result = outcome.result
    for line in result.problems[:_MAX_LISTED]:
        _progress(f"log problem: {line}")
    for line in outcome.live_problems[:_MAX_LISTED]:
        _progress(f"active version: {line}")
    if outcome.moved:
        _progress(f"{len(outcome.moved)} sessions changed during the rebuild, not compared: "
                  + ", ".join(outcome.moved[:20]) + (" ..." if len(outcome.moved) > 20 else ""))
    for line in outcome.differences[:_MAX_LISTED]:
        print(f"difference: {line}", flush=True)
    if len(outcome.differences) > _MAX_LISTED:
        print(f"... and {len(outcome.differences) - _MAX_LISTED} more differences")
    rate = result.events / result.seconds if result.seconds else 0.0
    print(json.dumps({"version": result.version, "topic": result.topic,
                      "events": result.events, "events_per_s": round(rate),
                      "sessions": len(result.conversations), "changes": result.changes,
                      "records_written": result.records_written,
                      "compared_with": outcome.compared_with,
                      "differences": len(outcome.differences),
                      "moved_sessions": len(outcome.moved),
                      "active_undecodable": outcome.live_undecodable,
                      "log_problems": len(result.problems), "switched": outcome.switched,
                      "processors_held": outcome.held}),
          flush=True)
    return 0 if outcome.switched else 1


def run_check(args: argparse.Namespace, settings: Settings) -> int:
    summary = asyncio.run(_check(settings, args))
    print(json.dumps(summary.to_json(), ensure_ascii=False), flush=True)
    return 0 if summary.ok else 1


async def _check(settings: Settings, args: argparse.Namespace) -> CheckSummary:
    summary = await check_topic(settings, EventSerde().decode, now_ms=int(time.time() * 1000),
                                open_turn_max_age_ms=args.open_turn_max_age,
                                sessions=args.sessions or None)
    if args.processors:
        logs = {sid: list(r.log.events) for sid, r in summary.reports.items()
                if r.log is not None and r.ok}
        report = await verify_processors(args.processors, logs, timeout_s=30.0)
        summary.derived_mismatches = report.derived_mismatches
        summary.extra_problems.extend(report.problems)
    return summary
