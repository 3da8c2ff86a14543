"""The scale-out run's verification (see :mod:`scale_out_support`), after every turn ended.

1. ``check``'s logic (:func:`~pipeline.services.replay.check.check_topic`) over the whole
   session topic, with an open-turn threshold of 0: any turn still open is a problem.
2. The processors' tables against core's folds of every log, through a surviving worker's
   HTTP API (:func:`~pipeline.services.processors.verify.verify_processors`): derived
   messages, usage per session, usage per model.
3. The replay: the session topic folded into a new projection version by the rebuild
   (:class:`~pipeline.services.replay.rebuild.Rebuilder`), compared with the compacted
   derived-messages topic the workers published (the comparison ``dsh-pipeline replay``
   makes before it switches). The workers publish asynchronously, so the live topic is read
   again until it matches or a deadline passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from pipeline.codec.avro import EventSerde
from pipeline.services.processors.verify import verify_processors
from pipeline.services.replay.check import CheckSummary, check_topic
from pipeline.services.replay.rebuild import Rebuilder, differences, read_conversations
from pipeline.settings import Settings

Log = Callable[[str], None]
VERIFY_TIMEOUT_S = 180.0


async def verify_run(settings: Settings, worker_url: str, log: Log) -> dict[str, Any]:
    """The three verifications' figures as one flat dict (``*_problems``: a few examples)."""
    began = time.monotonic()
    decode = EventSerde().decode
    summary = await check_topic(settings, decode, now_ms=int(time.time() * 1000),
                                open_turn_max_age_ms=0)
    checked = summary.to_json()
    log(f"check: {_without_problems(checked)}")
    logs = {sid: list(r.log.events) for sid, r in summary.reports.items() if r.log is not None}
    tables = await verify_processors(worker_url, logs, timeout_s=VERIFY_TIMEOUT_S,
                                     check_models=True)
    log(f"processors' tables vs core: derived_mismatches={tables.derived_mismatches} "
        f"usage_mismatches={tables.usage_mismatches} model_mismatches={tables.model_mismatches}")
    replay = await _replay_differences(settings, log)
    return {
        "check_ok": summary.ok, "check_sessions": checked["sessions"],
        "check_events": checked["events"], "invalid_sessions": checked["invalid_sessions"],
        "gaps": checked["gaps"], "duplicates": checked["duplicates"],
        "invalid_events": checked["invalid_events"],
        "open_turns": checked["open_turns_too_old"],
        "unanswered_calls": checked["unanswered_calls"],
        "undecodable_records": checked["undecodable_records"],
        "check_problems": _examples(summary),
        "derived_mismatches": tables.derived_mismatches,
        "usage_mismatches": tables.usage_mismatches,
        "model_mismatches": tables.model_mismatches,
        "table_problems": tables.problems[:5],
        **replay, "verify_s": round(time.monotonic() - began, 1),
    }


async def _replay_differences(settings: Settings, log: Log) -> dict[str, Any]:
    """Rebuild into version 1 and compare with the live (version 0) compacted topic."""
    result = await Rebuilder(settings, EventSerde().decode, 1).run()
    deadline = time.monotonic() + VERIFY_TIMEOUT_S
    while True:
        live = await read_conversations(settings, settings.topics.derived_messages) or {}
        found = differences(live, result.conversations, "processors")
        if not found or time.monotonic() > deadline:
            break
        await asyncio.sleep(1.0)
    log(f"replay: {result.events} events, {len(result.conversations)} conversations, "
        f"{len(found)} differences from the processors' topic, "
        f"{len(result.problems)} log problems")
    return {"replay_events": result.events, "replay_conversations": len(result.conversations),
            "replay_differences": len(found), "replay_log_problems": len(result.problems),
            "replay_problems": (found + result.problems)[:5]}


def _without_problems(checked: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in checked.items() if k != "problems"}


def _examples(summary: CheckSummary) -> list[str]:
    return [p for r in summary.reports.values() for p in r.problems][:5] + \
        summary.undecodable[:5]
