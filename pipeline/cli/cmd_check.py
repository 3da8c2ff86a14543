"""``dsh-pipeline check``: fsck of the session topic.

``check [SESSION...]``: seqs contiguous from 0, every event valid, no open turn too old, every
tool call of a finished turn answered, undecodable records (and, with ``--processors URL``, a
worker's derived tables against the log); a JSON summary, exit 1 on any problem.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from pipeline.cli.common import add_duration, add_session_argument
from pipeline.codec.avro import EventSerde
from pipeline.services.processors.verify import verify_processors
from pipeline.services.replay.check import CheckSummary, check_topic
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
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
