"""Dashboard ready time against a session topic that already holds history (issue 22).

A fleet of ``FLEET_SESSIONS`` sessions whose history grows: for 100k, 1M and 10M events,
each session has 100, 1,000 or 10,000 events of :func:`dsh_dev.synth.synth_session`
(turns, steps, tool calls, compactions, ~87% chunks), written interleaved as a live fleet
writes them (rounds of ``ROUND_EVENTS`` events of every session). A real ``dsh-pipeline
processors`` worker folds the history and publishes its outputs. Then the production state
of the compacted outputs is waited for: the history is made older than the output topics'
``max.compaction.lag.ms`` (the plan's, unchanged), one short live session per partition is
appended (a write is what rolls an active segment), and the wait ends when ``fleet`` and
``usage`` hold about one record per key (the log cleaner has run) or after
``CLEANER_WAIT_S``. The worker is stopped. Every size is set up first; then each run
launches ``dsh-pipeline dashboard`` on every size in turn (the sizes alternate) and times its
launch to the fleet shown (``/health`` ``ready``: ``fleet`` and ``usage`` read
to their start-up end offsets), interpreter start and imports included; the first answer of
``/health`` (the process started and serving) is reported beside it.

Writing the history: every session's events are the same template session encoded once
(Avro, the session id replaced in place: every id has the same length), sent by the bulk
producer, so that 10M events cost the sends and not 10M encodes. Sizes:
``DSH_BENCH_DASHBOARD_SIZES`` (default 100000,1000000,10000000); ``--quick``: 10k and 30k
events of 50 sessions, without the compaction wait.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_processors
from suite_core import CHECKOUT, Context, Figure, load_average

from dsh_dev.synth import synth_session
from pipeline.adapters.kafka.admin import OUTPUT_MAX_COMPACTION_LAG_MS, ensure_topics
from pipeline.adapters.kafka.compacted import CompactedFollow
from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.adapters.kafka.topic_scan import BulkProducer
from pipeline.codec.avro import EventSerde
from pipeline.codec.records import event_headers, record_key
from pipeline.settings import Settings

PARTITIONS = 3
FLEET_SESSIONS = 1_000
ROUND_EVENTS = 100
READY_TIMEOUT_S = 300.0
CLEANER_WAIT_S = 240.0
TEMPLATE_ID = "dash-s000000"


def _sizes(ctx: Context) -> list[int]:
    if ctx.quick:
        return [10_000, 30_000]
    raw = os.environ.get("DSH_BENCH_DASHBOARD_SIZES", "100000,1000000,10000000")
    return [int(part) for part in raw.split(",") if part.strip()]


def _label(size: int) -> str:
    return f"{size // 1_000_000}M" if size >= 1_000_000 else f"{size // 1000}k"


@dataclass(slots=True)
class History:
    """What one size's setup did, for the notes."""

    events: int
    sessions: int
    publish_s: float = 0.0
    fold_s: float = 0.0
    wait_s: float = 0.0
    before: tuple[int, int] = (0, 0)   # output records and keys once folded
    after: tuple[int, int] = (0, 0)    # ... once the cleaner ran


def bench_dashboard(ctx: Context) -> list[Figure]:
    """Every size is set up first; then each run launches a dashboard on every size in turn
    (sizes alternate run by run, so a change of the machine's load meets them all)."""
    sessions = ctx.size(FLEET_SESSIONS, 50)
    setups: dict[int, tuple[Settings, History]] = {}
    for index, size in enumerate(_sizes(ctx)):
        settings = ctx.settings(PARTITIONS)
        asyncio.run(ensure_topics(settings))
        history = History(size, sessions)
        started = time.monotonic()
        asyncio.run(publish_history(settings, 7 + index, size // sessions, sessions))
        history.publish_s = time.monotonic() - started
        ctx.log(f"dashboard {_label(size)}: {size:,} events of {sessions:,} sessions written "
                f"in {history.publish_s:.0f} s; the processors fold them")
        _fold_and_compact(ctx, settings, history)
        setups[size] = (settings, history)
    ready = {size: Figure(f"Dashboard: ready time with {_label(size)} events of history",
                          "s", [], higher_is_better=False,
                          goal="<= 5 s (issue 22)" if size >= 10_000_000 else "")
             for size in setups}
    serving: dict[int, list[float]] = {size: [] for size in setups}
    reads: dict[int, tuple[int, int]] = {}
    for run in range(ctx.runs):
        for size, (settings, _history) in setups.items():
            seconds, up_s, outputs, events = _ready_time(settings)
            ready[size].ours.append(seconds)
            serving[size].append(up_s)
            reads[size] = (outputs, events)
            ctx.log(f"  run {run + 1}, {_label(size)}: ready after {seconds:.2f} s (serving "
                    f"after {up_s:.2f} s), {outputs:,} output records, {events} session-"
                    f"topic records read (load average {load_average()})")
    figures: list[Figure] = []
    for size, figure in ready.items():
        figure.note = _note(ctx, setups[size][1], serving[size], reads[size])
        if figure.goal:
            figure.met = figure.median <= 5.0
        figures.append(figure)
        figures.append(Figure(
            f"Dashboard: records read to be ready with {_label(size)} events of history",
            "records", [float(sum(reads[size]))], higher_is_better=False,
            note=f"{reads[size][0]:,} output records (fleet and usage) and {reads[size][1]} "
                 "session-topic records; independent of the machine's load"))
    if len(ready) >= 2:
        sizes = sorted(ready)
        base, largest = ready[sizes[0]], ready[sizes[-1]]
        ratio = Figure(
            f"Dashboard: ready time at {_label(sizes[-1])} / at {_label(sizes[0])}", "x",
            [o / b for o, b in zip(largest.ours, base.ours, strict=False)],
            higher_is_better=False, goal="<= 1.5x (issue 22)",
            note="run by run (the sizes alternate within each run); the same fleet at every "
                 "size, so what grows is the history alone")
        ratio.met = ratio.median <= 1.5
        figures.append(ratio)
    return figures


def _note(ctx: Context, history: History, serving: list[float], reads: tuple[int, int]
          ) -> str:
    cleaned = ("quick run: the outputs were not left to the log cleaner" if ctx.quick else
               f"then {history.wait_s:.0f} s left to the log cleaner (history older than "
               f"max.compaction.lag.ms={OUTPUT_MAX_COMPACTION_LAG_MS}, one live session "
               "appended per partition; the wait ends at about one record per key or after "
               f"{CLEANER_WAIT_S:.0f} s more): fleet+usage went from "
               f"{history.before[0]:,} records ({history.before[1]:,} keys) to "
               f"{history.after[0]:,} ({history.after[1]:,} keys)")
    return (f"{history.events:,} events of {history.sessions:,} sessions "
            f"({history.events // history.sessions:,} each), written in "
            f"{history.publish_s:.0f} s, folded by one processors worker in "
            f"{history.fold_s:.0f} s; {cleaned}. From launching `dsh-pipeline dashboard` to "
            f"/health ready; its /health first answered after "
            f"{statistics.median(serving):.2f} s (median: interpreter, imports, web app); it "
            f"read {reads[0]:,} output records and {reads[1]} session-topic records")


def _session_ids(count: int) -> list[str]:
    return [f"dash-s{n:06d}" for n in range(count)]


async def publish_history(settings: Settings, seed: int, per_session: int,
                          sessions: int) -> None:
    """``sessions`` sessions of ``per_session`` template events each, interleaved by rounds
    of ``ROUND_EVENTS`` events per session."""
    serde = EventSerde()
    template = synth_session(seed, per_session)
    encoded = []
    for event in template:
        value = serde.encode(TEMPLATE_ID, event)
        if value.count(TEMPLATE_ID.encode()) != 1:
            raise RuntimeError("the template id is not found once in an encoded event")
        encoded.append((value, tuple(event_headers(event))))
    ids = [(sid.encode(), record_key(sid)) for sid in _session_ids(sessions)]
    topic, template_id = settings.topics.session_events, TEMPLATE_ID.encode()
    async with BulkProducer(settings) as bulk:
        for start in range(0, per_session, ROUND_EVENTS):
            round_ = encoded[start:start + ROUND_EVENTS]
            await bulk.send_many(topic, ((key, value.replace(template_id, sid), headers)
                                         for sid, key in ids for value, headers in round_))


def _fold_and_compact(ctx: Context, settings: Settings, history: History) -> None:
    """Run a worker until it committed the whole session topic, then (not quick) until the
    log cleaner compacted the outputs."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as state:
        worker = bench_processors.Worker(settings, bench_processors.free_port(), Path(state),
                                         ["--loglevel", "WARNING"])
        try:
            worker.wait_ready()
            bench_processors.settle(settings, timeout_s=3600.0)
            history.fold_s = time.monotonic() - started
            history.before = asyncio.run(output_records(settings))
            if not ctx.quick:
                _wait_compacted(ctx, settings, history)
        finally:
            worker.stop()


def _wait_compacted(ctx: Context, settings: Settings, history: History) -> None:
    started = time.monotonic()
    lag_s = int(OUTPUT_MAX_COMPACTION_LAG_MS) / 1000
    ctx.log(f"  folded in {history.fold_s:.0f} s; outputs {history.before[0]:,} records of "
            f"{history.before[1]:,} keys; waiting {lag_s:.0f} s (the compaction lag)")
    time.sleep(lag_s + 2)
    asyncio.run(_append_live_sessions(settings))
    bench_processors.settle(settings, timeout_s=600.0)
    while True:
        history.after = asyncio.run(output_records(settings))
        records, keys = history.after
        if records <= keys * 1.02 + 50 or time.monotonic() - started > lag_s + CLEANER_WAIT_S:
            break
        time.sleep(5)
    history.wait_s = time.monotonic() - started
    ctx.log(f"  after {history.wait_s:.0f} s: {records:,} output records of {keys:,} keys")


async def _append_live_sessions(settings: Settings) -> None:
    """A short session on every partition of the fleet and usage topics (keys
    ``<id>`` and ``session/<id>``): their writes roll the outputs' aged active segments."""
    serde = EventSerde()
    fleet: set[int] = set()
    usage: set[int] = set()
    live: list[str] = []
    for n in range(1000):
        sid = f"dash-live{n:03d}"
        parts = (partition_for(sid, PARTITIONS), partition_for(f"session/{sid}", PARTITIONS))
        if parts[0] not in fleet or parts[1] not in usage:
            live.append(sid)
            fleet.add(parts[0])
            usage.add(parts[1])
        if len(fleet) == len(usage) == PARTITIONS:
            break
    async with BulkProducer(settings) as bulk:
        for sid in live:
            for event in synth_session(99, 40):
                await bulk.send(settings.topics.session_events, record_key(sid),
                                serde.encode(sid, event), tuple(event_headers(event)))


async def output_records(settings: Settings) -> tuple[int, int]:
    """(records, distinct keys) in the fleet and usage topics now."""
    names = settings.topics
    records, keys = 0, set()
    async with CompactedFollow(settings, [names.fleet, names.usage]) as follow:
        async for batch in follow.snapshot():
            records += len(batch)
            keys.update((record.topic, record.key) for record in batch)
    return records, len(keys)


def _ready_time(settings: Settings) -> tuple[float, float, int, int]:
    """A ``dsh-pipeline dashboard`` process: (seconds from its launch to ``/health`` ready,
    seconds to its first ``/health`` answer, output records it read, session-topic records
    it read)."""
    env = {**os.environ, **settings.to_env(), "DSH_DASHBOARD_PORT": "0",
           "DSH_DASHBOARD_HOST": "127.0.0.1"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "dashboard"],
                            cwd=CHECKOUT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    serving: float | None = None
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]  # "dashboard: http://127.0.0.1:PORT/"
        while True:
            health = _health(url)
            if health and serving is None:
                serving = time.perf_counter() - started
            if health.get("ready"):
                seconds = time.perf_counter() - started
                break
            if time.perf_counter() - started > READY_TIMEOUT_S or proc.poll() is not None:
                raise RuntimeError(f"the dashboard was not ready: {health}")
            time.sleep(0.01)
        records = _output_records(url)
        return (seconds, serving or seconds, records,
                int(health["sessionTopicReads"]["records"]))
    finally:
        proc.terminate()
        proc.wait(30)


def _health(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + "health", timeout=5) as response:
            found: dict[str, Any] = json.loads(response.read())
            return found
    except (OSError, ValueError):
        return {}


def _output_records(url: str) -> int:
    """The dashboard's ``output_records_total`` (every topic), from its ``/metrics``."""
    with urllib.request.urlopen(url + "metrics", timeout=5) as response:
        text = response.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("dsh_dashboard_output_records_total{")))
