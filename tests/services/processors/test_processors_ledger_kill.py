"""The cost ledger is exactly once: a processors worker killed with kill -9 while usage
samples are in flight restarts, and the usage topic then holds exactly the ledger a fresh
replay of the same log gives (a new processors group on a copy of the log, from offset 0),
which is exactly the ledger summed directly from the provider-reported usage in the log
(:class:`pipeline.core.ledger.Ledger`), to the nano-unit. ``dsh-pipeline usage`` reads it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from processors_support import (
    ROOT,
    Worker,
    event_records,
    free_port,
    fresh_settings,
    generated_sessions,
    read_topic,
    worker_env,
)

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.core.events import Event
from pipeline.core.ledger import Ledger, LedgerLine
from pipeline.core.prices import prices_from_text
from pipeline.settings import Settings

pytestmark = pytest.mark.broker

PRICES = json.dumps({"led/m1": {"from": "2020-01-01", "input": "0.27", "cached_input": "0.07",
                                "cache_write": "0.3", "output": "1.1"},
                     "led/m2": [{"from": "2020-01-01", "input": "3", "output": "15"}]})
# led/m3 has no price: its calls are counted apart, never as 0
LEDGER_WAIT_S = 150.0


def _reference(sessions: dict[str, list[Event]]) -> dict[str, Any]:
    ledger = Ledger(prices_from_text(PRICES))
    for sid, events in sessions.items():
        ledger.add_log(sid, events)
    return ledger.records()


async def _ledger_on_topic(settings: Settings) -> dict[str, Any]:
    """The usage topic's ledger rows as compaction leaves them (last value per key)."""
    found: dict[str, Any] = {}
    for key, value, _headers in await read_topic(settings, settings.topics.usage):
        if key.startswith("tenant/"):
            found[key] = value
    return found


async def _wait_for_ledger(settings: Settings, expected: dict[str, Any],
                           worker: Worker) -> dict[str, Any]:
    deadline = time.monotonic() + LEDGER_WAIT_S
    found: dict[str, Any] = {}
    while time.monotonic() < deadline:
        found = await _ledger_on_topic(settings)
        if found == expected:
            return found
        await asyncio.sleep(1.0)
    missing = sorted(set(expected) - set(found))[:5]
    wrong = [k for k in expected if k in found and found[k] != expected[k]][:5]
    raise AssertionError(f"ledger differs: missing {missing}, wrong {wrong} "
                         f"({[(found[k], expected[k]) for k in wrong[:1]]}); "
                         f"log:\n{worker.tail()}")


def _handled(worker: Worker) -> int:
    return int(worker.get("/health")[1]["counters"]["records"])


async def _raw_log(settings: Settings) -> list[OutRecord]:
    """Every record of the session topic, per partition in offset order, to copy."""
    topic = settings.topics.session_events
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers,
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        out: list[OutRecord] = []
        while [tp for tp in parts if await consumer.position(tp) < ends[tp]]:
            for tp, records in (await consumer.getmany(*parts, timeout_ms=500)).items():
                out += [OutRecord("", r.key, r.value, tuple(r.headers), tp.partition)
                        for r in records]
        return out
    finally:
        await consumer.stop()


async def _run_killed(settings: Settings, tmp: Path, batch1: list[OutRecord],
                      rest: list[OutRecord]) -> int:
    """A worker folds part of ``batch1`` and is killed -9 with samples in flight."""
    worker = Worker(settings, free_port(), tmp, env={"DSH_PRICES": PRICES})
    sent = 0
    try:
        worker.wait_ready()
        while sent < len(batch1) and (handled := _handled(worker)) <= len(batch1) // 10:
            await send_records(settings, batch1[sent:sent + 40])
            sent += 40
            if handled == 0:
                await asyncio.sleep(0.2)
        handled_at_kill = _handled(worker)
    finally:
        worker.kill9()
    await send_records(settings, batch1[sent:])
    await send_records(settings, rest)
    return handled_at_kill


def _usage_cli(settings: Settings, tmp: Path, *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "usage", "--json", *args],
                          cwd=ROOT, env=worker_env(settings, tmp), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


async def test_ledger_after_kill9_equals_a_fresh_replay_and_the_direct_sum(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = fresh_settings(kafka_bootstrap)
    await ensure_topics(settings)
    sessions = generated_sessions(31, 30, "led", ["m1", "m2", "m3"], int(time.time() * 1000),
                                  max_chunks=30, tenants=["acme", "", "bee", "acme"])
    first = {sid: events[:len(events) // 2] for sid, events in sessions.items()}
    batch1 = [r for sid, events in first.items() for r in event_records(settings, sid, events)]
    rest = [r for sid, events in sessions.items()
            for r in event_records(settings, sid, events[len(events) // 2 - 3:])]  # 3 dups
    handled = await _run_killed(settings, tmp_path, batch1, rest)
    print(f"killed after {handled} of {len(batch1)} records")
    assert 0 < handled < len(batch1)

    expected = _reference(sessions)
    assert {r["dsh.tenant"] for r in expected.values()} == {"acme", "", "bee"}
    assert any("dsh.cost.nanos" not in r for r in expected.values())   # m3: unpriced
    restarted = Worker(settings, free_port(), tmp_path, env={"DSH_PRICES": PRICES})
    try:
        restarted.wait_ready()
        after_kill = await _wait_for_ledger(settings, expected, restarted)
    finally:
        restarted.stop()

    # A fresh replay: the same log copied to new topics, folded by a new group from 0.
    fresh = fresh_settings(kafka_bootstrap)
    await ensure_topics(fresh)
    log = await _raw_log(settings)
    await send_records(fresh, [OutRecord(fresh.topics.session_events, r.key, r.value,
                                         r.headers, r.partition) for r in log])
    replay = Worker(fresh, free_port(), tmp_path / "fresh", env={"DSH_PRICES": PRICES})
    try:
        replay.wait_ready()
        replayed = await _wait_for_ledger(fresh, expected, replay)
    finally:
        replay.stop()
    assert replayed == after_kill == expected   # to the nano-unit, key by key

    cli = _usage_cli(settings, tmp_path)
    lines = sorted((LedgerLine.from_record(r) for r in expected.values()),
                   key=lambda line: (line.tenant, line.model_key, line.start_ms))
    assert cli["rows"] == [line.to_json() for line in lines]
    costs = [line.cost_nanos for line in lines if line.cost_nanos is not None]
    assert cli["totals"]["costNanos"] == sum(costs)
    acme = _usage_cli(settings, tmp_path, "--tenant", "acme")
    assert acme["rows"] and {row["tenant"] for row in acme["rows"]} == {"acme"}
