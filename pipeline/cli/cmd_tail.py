"""``dsh-pipeline tail [SESSION]``: session events as they arrive, as kcat shows records.

Text (the default): turns at the margin, steps indented, streamed text assembled from its
chunks; colour only on a terminal and never with ``NO_COLOR`` set. ``--format json``: one JSON
object per event, ``{"session", "partition", "offset", "timestamp", "event"}``. ``--type``
keeps only the given event types (filtered by the ``dsh.type`` header: others are never
decoded). Where to start: the end (default), ``--from-beginning``, ``--from-seq N`` (of
SESSION) or ``--from-time T``. ``-c N`` stops after N events, ``-e`` at the end of the topic
as it was when tail started. SESSION from its beginning (or ``--from-seq``) reads the
session's partition only, from its first event when its fleet record names it (the
processors publish it), else from the partition's start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import UTC, datetime
from typing import Any, Final

from pipeline.adapters.kafka.event_stream import (
    At,
    EventRecord,
    EventStream,
    InSession,
    Start,
)
from pipeline.adapters.kafka.session_first import first_offset_of
from pipeline.cli.common import add_session_argument, parse_duration, use_colour
from pipeline.codec.avro import EventSerde
from pipeline.core.errors import ConfigError
from pipeline.services.replay.render import Renderer
from pipeline.settings import Settings

END_CHECK_S: Final = 0.5  # with -e: how often a stream with nothing new checks for the end


def register(subparsers: Any) -> None:
    tail = subparsers.add_parser("tail", help="live readable view of session events",
                                 description=__doc__)
    add_session_argument(tail, optional=True, help="only this session (default: all)")
    tail.add_argument("--format", choices=("text", "json"), default="text",
                      help="readable text, or one JSON object per event")
    tail.add_argument("--type", action="append", metavar="TYPE", dest="types",
                      help="only events of this type (repeat, or comma-separate, for more; "
                           "e.g. turn/start,turn/end)")
    start = tail.add_mutually_exclusive_group()
    start.add_argument("--from-beginning", action="store_true",
                       help="start at the beginning of the topic (default: its end)")
    start.add_argument("--from-seq", type=int, metavar="N",
                       help="start at event N of SESSION (needs SESSION)")
    start.add_argument("--from-time", metavar="T",
                       help="start at the events written at or after T: an ISO 8601 time "
                            "(2026-01-01T10:00:00Z) or a duration ago (10m, 2h)")
    tail.add_argument("-c", "--count", type=int, metavar="N",
                      help="stop after N events")
    tail.add_argument("-e", "--exit-at-end", action="store_true",
                      help="stop at the end of the topic (as it was when tail started)")
    tail.set_defaults(func=run_tail)


def start_of(args: argparse.Namespace, now_ms: int) -> Start | At:
    if args.from_seq is not None:
        if args.session is None:
            raise ConfigError("tail --from-seq N needs a SESSION")
        return Start.BEGINNING
    if args.from_beginning:
        return Start.BEGINNING
    if args.from_time is not None:
        return At(parse_time_ms(args.from_time, now_ms))
    return Start.END


def parse_time_ms(text: str, now_ms: int) -> int:
    """An ISO 8601 time (naive means UTC) or a duration ago, as epoch milliseconds."""
    try:
        return now_ms - round(parse_duration(text) * 1000)
    except argparse.ArgumentTypeError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"--from-time {text!r}: give an ISO 8601 time "
                          "(2026-01-01T10:00:00Z) or a duration ago (10m)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return round(moment.timestamp() * 1000)


def types_of(given: list[str] | None) -> frozenset[str] | None:
    if not given:
        return None
    return frozenset(t.strip() for item in given for t in item.split(",") if t.strip())


def run_tail(args: argparse.Namespace, settings: Settings) -> int:
    if args.count is not None and args.count < 1:
        raise ConfigError(f"-c must be at least 1, got {args.count}")
    start = start_of(args, int(time.time() * 1000))
    return asyncio.run(_tail(settings, args, start))


class _Output:
    def __init__(self, args: argparse.Namespace) -> None:
        self.json = args.format == "json"
        self.renderer = Renderer(colour=use_colour(sys.stdout),
                                 show_session=args.session is None)

    def write(self, record: EventRecord) -> None:
        if self.json:
            text = json.dumps({"session": record.session_id, "partition": record.partition,
                               "offset": record.offset, "timestamp": record.timestamp_ms,
                               "event": record.event.to_json()}, ensure_ascii=False) + "\n"
        else:
            text = self.renderer.feed(record.session_id, record.event)
        sys.stdout.write(text)
        sys.stdout.flush()

    def finish(self) -> None:
        if not self.json:
            sys.stdout.write(self.renderer.finish())
            sys.stdout.flush()


async def _tail(settings: Settings, args: argparse.Namespace, start: Start | At) -> int:
    output = _Output(args)
    shown = 0
    begin: Start | At | InSession = start
    if args.session is not None and start is Start.BEGINNING:
        # the session's partition alone, from its first event when the fleet says where
        begin = InSession(args.session, await first_offset_of(settings, args.session) or 0)
    async with EventStream(settings, decode=EventSerde().decode, start=begin,
                           types=types_of(args.types)) as stream:
        ends = await stream.end_offsets() if args.exit_at_end else None
        records = stream.__aiter__()
        pending: asyncio.Task[EventRecord] | None = None
        try:
            while args.count is None or shown < args.count:
                if ends is not None and await _at_end(stream, ends):
                    break
                if pending is None:
                    pending = asyncio.ensure_future(records.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=END_CHECK_S if ends else None)
                if not done:
                    continue
                record, pending = pending.result(), None
                if _wanted(record, args):
                    output.write(record)
                    shown += 1
        finally:
            if pending is not None:
                pending.cancel()
            output.finish()
    return 0


def _wanted(record: EventRecord, args: argparse.Namespace) -> bool:
    if args.session is not None and record.session_id != args.session:
        return False
    return args.from_seq is None or record.event.seq >= args.from_seq


async def _at_end(stream: EventStream, ends: dict[int, int]) -> bool:
    positions = await stream.positions()
    return all(positions.get(partition, 0) >= end for partition, end in ends.items())
