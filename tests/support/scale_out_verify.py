"""The scale-out run's verification (see :mod:`scale_out_support`), after every turn ended.

1. ``check``'s logic (:func:`~pipeline.services.replay.check.check_topic`) over the whole
   session topic, with an open-turn threshold of 0: any turn still open is a problem.
2. The processors' tables against core's folds of every log, through a surviving worker's
   HTTP API (:func:`~pipeline.services.processors.verify.verify_processors`: derived
   messages and usage per session, routed to the owner); the per-model totals, which each
   worker serves only for the models it owns, merged over every live worker.
3. The replay: the session topic folded into a new projection version by the rebuild
   (:class:`~pipeline.services.replay.rebuild.Rebuilder`), compared with the compacted
   derived-messages topic the workers published (the comparison ``dsh-pipeline replay``
   makes before it switches). The workers publish asynchronously, so the live topic is read
   again until it matches or a deadline passes.

When something differs, ``diagnosis`` says where: the partition of each example session, the
``nextSeq`` each worker reports for it, and per partition the processors group's committed
offset against the topic's end (committed at the end but a table behind it means updates
were skipped, not merely late).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner
from processors_support import committed_and_ends

from pipeline.adapters.kafka.options import client_options
from pipeline.codec.avro import EventSerde
from pipeline.codec.records import record_key
from pipeline.core.events import Event
from pipeline.core.usage import TokenCounts, UsageScan
from pipeline.services.processors.verify import (
    VerifyReport,
    counts_of_record,
    verify_processors,
)
from pipeline.services.replay.check import CheckSummary, check_topic
from pipeline.services.replay.rebuild import Rebuilder, differences, read_conversations
from pipeline.settings import Settings

Log = Callable[[str], None]
# Every turn has ended when verification starts: the workers only have their last batches
# to fold, so a minute is ample even on a loaded machine; past it, a difference is real.
VERIFY_TIMEOUT_S = 60.0
VERIFY_SLICES = 8


async def verify_run(settings: Settings, worker_urls: Sequence[str], log: Log
                     ) -> dict[str, Any]:
    """The three verifications' figures as one flat dict (``*_problems``: a few examples)."""
    began = time.monotonic()
    summary = await check_topic(settings, EventSerde().decode, now_ms=int(time.time() * 1000),
                                open_turn_max_age_ms=0)
    checked = summary.to_json()
    log(f"check: { {k: v for k, v in checked.items() if k != 'problems'} }")
    logs = {sid: list(r.log.events) for sid, r in summary.reports.items() if r.log is not None}
    tables = await _verify_tables(worker_urls[0], logs)
    models = await asyncio.to_thread(_model_differences, worker_urls, logs)
    log(f"processors' tables vs core: derived_mismatches={tables.derived_mismatches} "
        f"usage_mismatches={tables.usage_mismatches} model_mismatches={len(models)}")
    replay = await _replay_differences(settings, log)
    uncommitted = await _records_past_the_commit(settings)
    log(f"records past the processors group's committed offsets: {uncommitted}")
    figures = {
        **_check_figures(checked, summary),
        "derived_mismatches": tables.derived_mismatches,
        "usage_mismatches": tables.usage_mismatches, "model_mismatches": len(models),
        "table_problems": (tables.problems + models)[:5], **replay,
        "uncommitted_records": sum(uncommitted.values()),
    }
    if tables.problems or models or replay["replay_differences"] or any(uncommitted.values()):
        figures["diagnosis"] = await _diagnose(settings, worker_urls, tables.problems)
        log(f"diagnosis: {figures['diagnosis']}")
    figures["verify_s"] = round(time.monotonic() - began, 1)
    return figures


def _check_figures(checked: Mapping[str, Any], summary: CheckSummary) -> dict[str, Any]:
    examples = [p for r in summary.reports.values() for p in r.problems][:5]
    return {
        "check_ok": summary.ok, "check_sessions": checked["sessions"],
        "check_events": checked["events"], "invalid_sessions": checked["invalid_sessions"],
        "gaps": checked["gaps"], "duplicates": checked["duplicates"],
        "invalid_events": checked["invalid_events"],
        "open_turns": checked["open_turns_too_old"],
        "unanswered_calls": checked["unanswered_calls"],
        "undecodable_records": checked["undecodable_records"],
        "check_problems": examples + summary.undecodable[:5],
    }


async def _verify_tables(worker_url: str, logs: Mapping[str, Sequence[Event]]
                         ) -> VerifyReport:
    """:func:`verify_processors` over slices of the sessions at once (one HTTP request at a
    time per slice): thousands of sessions in seconds rather than minutes."""
    ids = sorted(logs)
    slices = [{sid: logs[sid] for sid in ids[n::VERIFY_SLICES]} for n in range(VERIFY_SLICES)]
    reports = await asyncio.gather(*(verify_processors(worker_url, part,
                                                       timeout_s=VERIFY_TIMEOUT_S)
                                     for part in slices if part))
    merged = VerifyReport(sessions=len(logs))
    for report in reports:
        merged.derived_mismatches += report.derived_mismatches
        merged.usage_mismatches += report.usage_mismatches
        merged.problems += report.problems
    merged.problems.sort()
    return merged


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _model_differences(worker_urls: Sequence[str], logs: Mapping[str, Sequence[Event]]
                       ) -> list[str]:
    """Model totals merged over the workers against the full scan, polled until equal or
    the deadline passes (they are folded one stage later, after a repartition)."""
    scan = UsageScan()
    for session_id, events in logs.items():
        scan.add_log(session_id, events)
    deadline = time.monotonic() + VERIFY_TIMEOUT_S
    while True:
        found: dict[str, TokenCounts] = {}
        for url in worker_urls:
            for model in _get_json(f"{url}/usage/models")["models"]:
                key = f"{model['gen_ai.provider.name']}/{model['gen_ai.request.model']}"
                found[key] = counts_of_record(model)
        wrong = [f"model {key}: {found.get(key)} != full scan {scan.by_model.get(key)}"
                 for key in sorted(set(found) | set(scan.by_model))
                 if found.get(key) != scan.by_model.get(key)]
        if not wrong or time.monotonic() > deadline:
            return wrong
        time.sleep(0.5)


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


async def _diagnose(settings: Settings, worker_urls: Sequence[str],
                    problems: Sequence[str]) -> list[str]:
    """Where the tables went wrong: example sessions' partitions and the workers' nextSeq
    for them, each worker's ``/health`` (partitions, recovery, counters: duplicates equal
    to the records past the commit say a fold was dropped), and the processors group's
    committed offsets against the topic's ends."""
    partitioner, every = DefaultPartitioner(), list(range(settings.partitions))
    found: list[str] = []
    for session_id in sorted({p.split(":", 1)[0] for p in problems})[:2]:
        partition = partitioner(record_key(session_id), every, every)
        seqs = []
        for url in worker_urls:
            try:
                body = await asyncio.to_thread(
                    _get_json, f"{url}/sessions/{session_id}/messages")
                seqs.append(f"{body.get('nextSeq')} ({len(body.get('messages', []))} msgs)")
            except (OSError, ValueError) as exc:
                seqs.append(f"error {exc}")
        found.append(f"{session_id}: partition {partition}, worker nextSeq {seqs}")
        for isolation in ("read_committed", "read_uncommitted"):
            records = await _session_records(settings, partition, session_id, isolation)
            found.append(f"{session_id} {isolation} offset:seq:type {records}")
    for url in worker_urls:
        try:
            body = await asyncio.to_thread(_get_json, f"{url}/health")
        except (OSError, ValueError) as exc:
            body = str(exc)
        found.append(f"{url}/health: {json.dumps(body)}")
    found.append(f"processors group committed/end per partition: "
                 f"{await _group_lag(settings)}")
    return found


async def _records_past_the_commit(settings: Settings) -> dict[int, int]:
    """Per partition, the committed records at or past the processors group's committed
    offset, once it stops moving (the workers commit every few seconds): 0 everywhere when
    every batch was folded and committed. Offsets alone cannot say it: a partition's end
    may be a transaction marker, which no batch covers until the next record arrives."""
    deadline, found = time.monotonic() + VERIFY_TIMEOUT_S, {}
    while time.monotonic() < deadline:
        found = await _count_past_commit(settings)
        if not any(found.values()):
            break
        await asyncio.sleep(1.0)
    return found


async def _count_past_commit(settings: Settings) -> dict[int, int]:
    committed, _ends = await committed_and_ends(settings)
    reader = AIOKafkaConsumer(**client_options(settings), enable_auto_commit=False,
                              isolation_level="read_committed")
    await reader.start()
    try:
        tps = [TopicPartition(settings.topics.session_events, p)
               for p in range(settings.partitions)]
        ends = await reader.end_offsets(tps)
        reader.assign(tps)
        counts = {}
        for tp in tps:
            reader.seek(tp, committed[tp.partition])
            counts[tp.partition] = 0
            stop_at = time.monotonic() + 10
            while await reader.position(tp) < ends[tp] and time.monotonic() < stop_at:
                batch = await reader.getmany(tp, timeout_ms=1000)
                counts[tp.partition] += len(batch.get(tp, []))
        return counts
    finally:
        await reader.stop()


async def _session_records(settings: Settings, partition: int, session_id: str,
                           isolation: str) -> list[str]:
    """``offset:seq:type`` of one session's records in its partition (headers only)."""
    reader = AIOKafkaConsumer(**client_options(settings), enable_auto_commit=False,
                              isolation_level=isolation)
    await reader.start()
    try:
        tp = TopicPartition(settings.topics.session_events, partition)
        end = (await reader.end_offsets([tp]))[tp]
        reader.assign([tp])
        reader.seek(tp, 0)
        found, stop_at, key = [], time.monotonic() + 10, record_key(session_id)
        while await reader.position(tp) < end and time.monotonic() < stop_at:
            for record in (await reader.getmany(tp, timeout_ms=1000)).get(tp, []):
                if record.key == key:
                    headers = dict(record.headers)
                    found.append(f"{record.offset}:{headers.get('dsh.seq', b'?').decode()}:"
                                 f"{headers.get('dsh.type', b'?').decode()}")
        return found
    finally:
        await reader.stop()


async def _group_lag(settings: Settings) -> dict[int, str]:
    committed, ends = await committed_and_ends(settings)
    return {p: f"{committed[p]}/{ends[p]}" for p in ends}
