"""``dsh-pipeline sessions``: the sessions of the fleet, from the processors' outputs.

Reads ``<prefix>fleet`` and the ``session/<id>`` records of ``<prefix>usage`` (compacted) up
to their end offsets (read committed), never the session topic: its cost is the size of those
outputs, whatever the length of the history. Shows what the processors last published (a
processors worker must have run over the sessions). Undecodable records are counted on
stderr, never fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping
from typing import Any, Final

from pipeline.adapters.kafka.compacted import CompactedFollow
from pipeline.adapters.registry.outputs import output_decoder
from pipeline.codec.output_views import OutputView
from pipeline.codec.outputs import FLEET_STATUS, USAGE_RECORD
from pipeline.core.errors import BrokerError
from pipeline.core.events import JsonValue
from pipeline.settings import Settings

STATES: Final = ("all", "idle", "in-turn")
COLUMNS: Final = ("session", "state", "turns", "last activity", "tokens in", "tokens out")


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sessions", help="list the sessions of the fleet (from the processors' outputs)",
        description="List the fleet's sessions (id, state, turns, last activity, tokens) from "
                    "the processors' compacted fleet and usage topics, never the session "
                    "topic: fast whatever the history. A processors worker must have run.")
    parser.add_argument("--state", choices=STATES, default="all",
                        help="only sessions in this state")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON array of session objects instead of a table")
    parser.add_argument("--limit", type=int, default=0,
                        help="at most this many, most recently active first (0: all)")
    parser.set_defaults(func=run_sessions)


def run_sessions(args: argparse.Namespace, settings: Settings) -> int:
    fleet, usage = asyncio.run(read_outputs(settings))
    rows = session_rows(fleet.values, usage.values, args.state)
    if args.limit > 0:
        rows = rows[:args.limit]
    skipped = fleet.undecodable + usage.undecodable
    if skipped:
        last = (list(fleet.problems) + list(usage.problems))[-1]
        print(f"sessions: {skipped} undecodable records skipped (last: {last})",
              file=sys.stderr)
    if args.json:
        print(json.dumps(rows), flush=True)
    else:
        print(render_table(rows, int(time.time() * 1000)), flush=True)
    return 0


async def read_outputs(settings: Settings) -> tuple[OutputView, OutputView]:
    """``fleet`` and ``usage`` folded up to their end offsets of now."""
    decoder = output_decoder(settings)
    views = {settings.topics.fleet: OutputView(decoder, FLEET_STATUS),
             settings.topics.usage: OutputView(decoder, USAGE_RECORD)}
    async with CompactedFollow(settings, list(views)) as follow:
        if follow.missing:
            raise BrokerError(f"topics {follow.missing} do not exist: run `dsh-pipeline topics "
                              "ensure` and a processors worker (`dsh-pipeline processors`)")
        async for batch in follow.snapshot():
            for record in batch:
                views[record.topic].apply(record)
    return views[settings.topics.fleet], views[settings.topics.usage]


def session_rows(fleet: Mapping[str, Mapping[str, JsonValue]],
                 usage: Mapping[str, Mapping[str, JsonValue]], state: str = "all"
                 ) -> list[dict[str, JsonValue]]:
    """One object per session (``state`` "all" or the one wanted), most recently active
    first: id, state, turn/step, turns, last activity, last end reason, tokens."""
    rows: list[dict[str, JsonValue]] = []
    for session_id, status in fleet.items():
        if state != "all" and status.get("state") != state:
            continue
        totals = usage.get(f"session/{session_id}", {})
        rows.append({"session_id": session_id, "state": status.get("state"),
                     "turn": status.get("turn"), "step": status.get("step"),
                     "turns": status.get("turns"),
                     "last_activity_ms": status.get("last_activity_ms"),
                     "last_end_reason": status.get("last_end_reason"),
                     "input_tokens": totals.get("gen_ai.usage.input_tokens", 0),
                     "output_tokens": totals.get("gen_ai.usage.output_tokens", 0)})
    rows.sort(key=lambda r: (-_int(r["last_activity_ms"]), str(r["session_id"])))
    return rows


def render_table(rows: list[dict[str, JsonValue]], now_ms: int) -> str:
    lines = [list(COLUMNS)]
    for row in rows:
        state = str(row["state"])
        if state == "in-turn":
            state = f"turn {row['turn']}" + (f" step {row['step']}" if row["step"] else "")
        lines.append([str(row["session_id"]), state, str(row["turns"] or 0),
                      _ago(row["last_activity_ms"], now_ms),
                      f"{_int(row['input_tokens']):,}", f"{_int(row['output_tokens']):,}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    text = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
            for line in lines]
    return "\n".join([*text, f"{len(rows)} sessions"])


def _ago(ms: JsonValue, now_ms: int) -> str:
    if not isinstance(ms, int):
        return "-"
    seconds = max(0, now_ms - ms) // 1000
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def _int(value: JsonValue) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
