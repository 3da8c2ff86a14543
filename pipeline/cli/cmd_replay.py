"""``dsh-pipeline replay``: rebuild derived messages into a new version, or print a session.

``replay``: rebuild derived-messages into a new version, verify, hand it over from the live
processors (they hold while it catches up, then publish into it), switch readers;
``replay --withdraw-handover`` clears the handover of a replay that died holding them;
``replay SESSION [--jsonl|--transcript]`` prints one session from the topic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from pipeline.adapters.registry.client import RegistryClient
from pipeline.adapters.registry.outputs import output_codecs_for_topics, registry_lookup
from pipeline.cli.common import add_duration, add_session_argument, progress_line
from pipeline.codec.avro import EventSerde
from pipeline.codec.outputs import DerivedChangeSerde
from pipeline.codec.schemas import SchemaTable
from pipeline.core.errors import ConfigError
from pipeline.services.replay.rebuild import replay_projection
from pipeline.services.replay.render import transcript
from pipeline.services.replay.transfer import read_session
from pipeline.services.replay.versions import HANDOVER_TIMEOUT_S, withdraw_handover
from pipeline.settings import Settings

_MAX_LISTED = 200  # differences printed one per line; the rest counted


def register(subparsers: Any) -> None:
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
        progress_line("no handover is pending: nothing withdrawn")
    else:
        progress_line(f"withdrew the handover to version {withdrawn.version} ({withdrawn.topic}, "
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
                                      progress=progress_line, handover_timeout_s=timeout_s,
                                      encoder=encoder)
    result = outcome.result
    for line in result.problems[:_MAX_LISTED]:
        progress_line(f"log problem: {line}")
    for line in outcome.live_problems[:_MAX_LISTED]:
        progress_line(f"active version: {line}")
    if outcome.moved:
        progress_line(f"{len(outcome.moved)} sessions changed during the rebuild, not compared: "
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
