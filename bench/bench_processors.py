"""Processors worker: sustained events/s and append -> derived-change latency (issue 5).

Usage: .venv/bin/python bench/bench_processors.py [--quick] [--events 200000] [--rate 5000]
       [--seconds 10] [--bootstrap HOST:PORT]   (default: start a local single-node Kafka)

``--events`` sizes the generated sessions (``events // 260`` sessions of ~185 events each, so
the published count, printed, is about 70% of it); ``--quick`` is 60,000 and 3 s of latency.

(a) Throughput, one worker. Generated sessions (turns, steps, tool calls, replaces, usage;
chunks are most of the records, the share is printed) are published to a fresh session topic
first; then one ``dsh-pipeline processors`` worker (memory store, 3 partitions) starts and the
figure is the records it handled between its first and its last record (polled on
``GET /health``, so +-0.2 s), per second of wall time and per CPU-second of the worker
process (user + system, from /proc), tables, changelogs, outputs and per-model stage included.

(b) Latency. With that worker caught up, sessions are appended at ``--rate`` events/s for
``--seconds`` (paced by wall clock, a fresh producer, linger 1 ms, in a child process so the
two sides do not share an event loop) while a consumer tails
``derived-messages``; for every surface event, the latency is the wall-clock time at which
its derived change was READ by that consumer minus the time it was handed to the producer
(same machine, same clock). p50/p99/max over all surface events; a change never read within
the deadline counts as missing. The split printed under it, per surface event: append -> the
broker acknowledged the append (the appending side's own delays), append -> the worker's
producer stamped the derived change (CreateTime: fetch, queueing in the worker, fold), and
that stamp -> read back (the output's linger and ack, the read-back consumer's fetch).

(c) (skipped with ``--no-group``) Throughput, two workers in one group, on a fresh topic
set with a backlog twice as large (as large with ``--quick``): both start together; the
figure covers the window from the moment both own partitions and are out of recovery until
the backlog is folded (records handled by both in that window, per wall second and per
CPU-second of both together).

The machine is shared: every figure is printed with the load average at its start. Figures
are per process, so per CPU-second is the one comparable across loads.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from processes import cpu_seconds
from processors_support import (
    Worker,
    committed_and_ends,
    event_records,
    free_port,
    generated_sessions,
)

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.codec.outputs import OutputDecoder
from pipeline.core.events import Event
from pipeline.settings import Settings

PARTITIONS = 3
_OUTPUTS = OutputDecoder()  # derived-messages values are Avro records


def make_sessions(seed: int, events: int, prefix: str) -> dict[str, list[Event]]:
    count = max(1, events // 260)
    return generated_sessions(seed, count, prefix, ["m1", "m2"], int(time.time() * 1000),
                              max_chunks=60)


async def publish(settings: Settings, sessions: dict[str, list[Event]]) -> int:
    records = [r for sid, events in sessions.items()
               for r in event_records(settings, sid, events)]
    for start in range(0, len(records), 5000):
        await send_records(settings, records[start:start + 5000])
    return len(records)



def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def handled(worker: Worker) -> int:
    return int(worker.get("/health")[1]["counters"]["records"])


def settle(settings: Settings, timeout_s: float = 120.0) -> float:
    """Wait until the worker committed the whole session topic (its table and output writes
    flushed: a commit waits for them), so that a latency run measures a steady worker, not
    the tail of the backlog it just folded. Returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if asyncio.run(_lag(settings)) == 0:
            break
        time.sleep(0.5)
    return time.monotonic() - started


async def _lag(settings: Settings) -> int:
    committed, ends = await committed_and_ends(settings)
    return sum(ends[p] - committed[p] for p in ends)


def throughput(worker: Worker, total: int) -> tuple[float, float, float]:
    """(records per wall second, wall seconds, records per worker CPU second)."""
    first: tuple[float, int, float] | None = None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        count = handled(worker)
        now, cpu = time.monotonic(), cpu_seconds(worker.proc.pid)
        if first is None and count > 0:
            first = (now, count, cpu)
        if count >= total and first is not None:
            done = count - first[1]
            return (done / max(now - first[0], 1e-9), now - first[0],
                    done / max(cpu - first[2], 1e-9))
        time.sleep(0.2)
    raise SystemExit(f"worker did not finish: {worker.tail()}")


@dataclass(frozen=True, slots=True)
class GroupRun:
    """What two workers folded once both owned partitions (the measured window)."""

    records: int
    wall_s: float
    cpu_s: float
    per_worker: tuple[int, ...]
    settled: bool = True  # False: the backlog was gone before both owned partitions

    @property
    def per_second(self) -> float:
        return self.records / max(self.wall_s, 1e-9)

    @property
    def per_cpu_second(self) -> float:
        return self.records / max(self.cpu_s, 1e-9)


def _settled(worker: Worker) -> bool:
    status, body = worker.get("/health")
    return (status == 200 and bool(body["partitions"])
            and not body["recovery"]["in_recovery"])


def group_throughput(workers: Sequence[Worker], total: int) -> GroupRun:
    """Records folded by ``workers`` together from when all are settled until ``total``.

    When the backlog is folded before both settled (a small ``--quick`` backlog, a slow
    rebalance), the window is the whole run from the first record handled instead, and the
    result says so (``settled=False``): a figure, but not one of two workers sharing the work.
    """
    for worker in workers:
        worker.wait_for("worker answering", lambda w=worker: w.get("/health")[0] == 200, 300)
    deadline = time.monotonic() + 900
    first: tuple[float, list[int], float] | None = None
    start: tuple[float, list[int], float] | None = None
    while time.monotonic() < deadline:
        counts = [handled(w) for w in workers]
        now, cpu = time.monotonic(), sum(cpu_seconds(w.proc.pid) for w in workers)
        if first is None and sum(counts) > 0:
            first = (now, counts, cpu)
        if start is None and sum(counts) < total and all(_settled(w) for w in workers):
            start = (now, counts, cpu)
        if sum(counts) >= total and (start or first) is not None:
            began = start or first
            assert began is not None
            done = [c - s for c, s in zip(counts, began[1], strict=True)]
            return GroupRun(sum(done), now - began[0], cpu - began[2], tuple(done),
                            settled=start is not None)
        time.sleep(0.2)
    raise SystemExit(f"workers did not finish: {[w.tail(10) for w in workers]}")


Stamps = dict[tuple[str, int], float]


async def paced_append(settings: Settings, sessions: dict[str, list[Event]], rate: float
                       ) -> tuple[Stamps, Stamps]:
    """Append interleaved sessions at ``rate`` events/s; returns the wall-clock ms at which
    each surface event was handed to the producer (also its CreateTime), and at which the
    broker acknowledged it."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, linger_ms=1)
    await producer.start()
    by_session = {sid: iter(event_records(settings, sid, events))
                  for sid, events in sessions.items()}
    interleaved = sorted(((sid, e) for sid, events in sessions.items() for e in events),
                         key=lambda item: (item[1].seq, item[0]))
    sent: Stamps = {}
    acked: Stamps = {}
    began = time.monotonic()
    try:
        for index, (sid, event) in enumerate(interleaved):
            # Yield even when behind: aiokafka's sender runs on this loop too.
            await asyncio.sleep(max(0.0, began + index / rate - time.monotonic()))
            record = next(by_session[sid])
            stamp = int(time.time() * 1000)
            delivery = await producer.send(record.topic, record.value, key=record.key,
                                           headers=list(record.headers), timestamp_ms=stamp)
            if event.surface_op is not None:
                sent[(sid, event.seq)] = stamp
                delivery.add_done_callback(
                    lambda _, key=(sid, event.seq): acked.setdefault(key, time.time() * 1000))
        await producer.flush()
    finally:
        await producer.stop()
    return sent, acked


def _wanted_key(raw: bytes | None, prefix: str) -> tuple[str, int] | None:
    """(session, seq) of a derived change that an event of this latency run (its sessions
    start with ``prefix``) appended or replaced into a slot. Changes of other sessions (a
    backlog still being published) must not count, or the read-back stops early."""
    if raw is None:
        return None
    value: Any = _OUTPUTS.decode(raw)
    if value["seq"] != value["changeSeq"] or not str(value["session"]).startswith(prefix):
        return None
    return value["session"], value["changeSeq"]


def latency_prefix(seed: int) -> str:
    """Session ids of one latency run: a second run on the same topics (another rate) must
    not reuse the first one's ids, or its events are duplicates the worker rightly ignores."""
    return f"lat{seed}"


def _append_child(bootstrap: str, topic_prefix: str, seed: int, events: int, rate: float,
                  out: str) -> None:
    """Child process of :func:`readable_latencies`: paced appends, stamps written to ``out``."""
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=topic_prefix,
                                 partitions=PARTITIONS)
    prefix = latency_prefix(seed)
    sessions = make_sessions(seed, events, prefix)
    gc.freeze()  # the instrument's own collector pauses are not the worker's latency
    sent, acked = asyncio.run(paced_append(settings, sessions, rate))
    Path(out).write_text(json.dumps([[sid, seq, stamp, acked[(sid, seq)]]
                                     for (sid, seq), stamp in sent.items()]))


@dataclass(frozen=True, slots=True)
class LatencyRun:
    """Per surface event read back: append -> read (``total``), split at the derived
    change's CreateTime (the worker's producer stamps it when the fold hands it over):
    ``to_send`` (fetch, queueing, fold) and ``to_read`` (linger, broker ack, the read-back
    consumer's fetch); ``to_ack``: append -> the broker acknowledged the append (the
    appending child's own producer delays included); ``surface``: surface events appended."""

    total: list[float]
    to_ack: list[float]
    to_send: list[float]
    to_read: list[float]
    surface: int


async def readable_latencies(settings: Settings, seed: int, events: int, rate: float
                             ) -> LatencyRun:
    """Append ~``events`` at ``rate`` while tailing derived-messages (latencies in ms and
    their split, see :class:`LatencyRun`).

    Latency = wall clock when the change was read back - when its event was handed to the
    producer. The appends run in a child process, so that neither side's event loop delays
    the other's (both read this machine's clock). Both sides freeze their heaps for the run:
    the instrument's own collector pauses are not the worker's latency.
    """
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers,
                                enable_auto_commit=False, fetch_max_wait_ms=20)
    await consumer.start()
    parts = [TopicPartition(settings.topics.derived_messages, p)
             for p in range(settings.partitions)]
    consumer.assign(parts)
    await consumer.seek_to_end(*parts)
    for tp in parts:
        await consumer.position(tp)   # resolve "end" now, before anything is appended
    prefix = latency_prefix(seed)
    sessions = make_sessions(seed, events, prefix)
    expected = sum(1 for es in sessions.values() for e in es if e.surface_op is not None)
    read_at: dict[tuple[str, int], tuple[float, float]] = {}
    # This process holds the suite's whole heap: a full collection of it (measured at up to
    # 80 ms) would land in the figure as the worker's latency.
    gc.freeze()
    try:
        return await _read_back(consumer, settings, seed, events, rate, expected, read_at)
    finally:
        gc.unfreeze()


async def _read_back(consumer: AIOKafkaConsumer, settings: Settings, seed: int, events: int,
                     rate: float, expected: int,
                     read_at: dict[tuple[str, int], tuple[float, float]]) -> LatencyRun:
    import multiprocessing
    prefix = latency_prefix(seed)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        child = multiprocessing.get_context("spawn").Process(
            target=_append_child, args=(settings.bootstrap_servers, settings.topic_prefix,
                                        seed, events, rate, out.name))
        child.start()
        try:
            deadline = time.monotonic() + events / rate + 60
            while len(read_at) < expected and time.monotonic() < deadline:
                for records in (await consumer.getmany(timeout_ms=100)).values():
                    now = time.time() * 1000
                    for r in records:
                        key = _wanted_key(r.value, prefix)
                        if key is not None:
                            read_at.setdefault(key, (now, float(r.timestamp)))
            child.join(60)
        finally:
            if child.is_alive():
                child.kill()
            await consumer.stop()
        sent = {(sid, seq): (stamp, acked)
                for sid, seq, stamp, acked in json.loads(Path(out.name).read_text())}
    found = [(read_at[key], stamps) for key, stamps in sent.items() if key in read_at]
    return LatencyRun([read - stamp for (read, _), (stamp, _) in found],
                      [acked - stamp for _, (stamp, acked) in found],
                      [created - stamp for (_, created), (stamp, _) in found],
                      [read - created for (read, created), _ in found], len(sent))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fresh_settings(bootstrap: str, tag: str) -> Settings:
    prefix = f"bench{tag}{uuid.uuid4().hex[:8]}."
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                                 partitions=PARTITIONS, group_id_prefix=f"{prefix}g-")
    asyncio.run(ensure_topics(settings))
    return settings


def one_worker(bootstrap: str, events: int, rate: float, seconds: float) -> dict[str, float]:
    settings = fresh_settings(bootstrap, "a")
    sessions = make_sessions(1, events, "tp")
    total = asyncio.run(publish(settings, sessions))
    chunks = sum(1 for es in sessions.values() for e in es if e.type == "assistant/chunk")
    print(f"published {total} events ({chunks / total:.0%} assistant/chunk) "
          f"in {len(sessions)} sessions, {PARTITIONS} partitions")
    with tempfile.TemporaryDirectory() as state:
        worker = Worker(settings, free_port(), Path(state), ["--loglevel", "WARNING"])
        try:
            worker.wait_ready()
            load = load_average()
            per_s, took, per_cpu_s = throughput(worker, total)
            print(f"(a) one worker: {per_s:,.0f} events/s wall ({total} events in {took:.1f} s)"
                  f"; {per_cpu_s:,.0f} events per worker CPU-second  [load {load}]")
            print(f"    the worker committed the whole backlog {settle(settings):.1f} s later")
            load = load_average()
            cpu_before = cpu_seconds(worker.proc.pid)
            run = asyncio.run(readable_latencies(settings, 2, int(rate * seconds), rate))
            busy = cpu_seconds(worker.proc.pid) - cpu_before
            lat, surface = run.total, run.surface
            if not lat:
                raise SystemExit(f"no derived change read back; worker log:\n{worker.tail()}")
            print(f"(b) latency append -> derived change read, at {rate:,.0f} events/s for "
                  f"{seconds:g} s: p50 {percentile(lat, 0.5):.0f} ms, p99 "
                  f"{percentile(lat, 0.99):.0f} ms, max {max(lat):.0f} ms over {len(lat)} of "
                  f"{surface} surface events  [load {load}]")
            print(f"    worker CPU during (b): {busy:.1f} s for ~{rate * seconds:,.0f} events "
                  f"({busy / seconds:.0%} of a core); append -> append acked by the broker: "
                  f"p50 {percentile(run.to_ack, 0.5):.0f} ms, p99 "
                  f"{percentile(run.to_ack, 0.99):.0f} ms")
            print(f"    append -> worker sent the change: p50 {percentile(run.to_send, 0.5):.0f}"
                  f" ms, p99 {percentile(run.to_send, 0.99):.0f} ms; sent -> read back: p50 "
                  f"{percentile(run.to_read, 0.5):.0f} ms, p99 "
                  f"{percentile(run.to_read, 0.99):.0f} ms")
            return {"events_per_s": per_s, "events_per_cpu_s": per_cpu_s,
                    "p50_ms": percentile(lat, 0.5), "p99_ms": percentile(lat, 0.99),
                    "read_back": len(lat) / max(surface, 1)}
        finally:
            worker.stop()


def two_workers(bootstrap: str, events: int) -> GroupRun:
    settings = fresh_settings(bootstrap, "c")
    total = asyncio.run(publish(settings, make_sessions(3, events, "tw")))
    with tempfile.TemporaryDirectory() as state:
        workers = [Worker(settings, free_port(), Path(state), ["--loglevel", "WARNING"])
                   for _ in range(2)]
        try:
            load = load_average()
            run = group_throughput(workers, total)
            caveat = ("" if run.settled and run.records >= total / 2 else
                      f"; ONLY {run.records / total:.0%} OF THE BACKLOG WAS LEFT when both "
                      "owned partitions: raise --events for a figure worth reading"
                      if run.settled else "; THE BACKLOG WAS FOLDED BEFORE BOTH OWNED "
                      "PARTITIONS: the window is the whole run, raise --events")
            print(f"(c) two workers, one group: {run.per_second:,.0f} events/s wall "
                  f"({run.records} events in {run.wall_s:.1f} s once both owned partitions; "
                  f"{'/'.join(str(n) for n in run.per_worker)} per worker); "
                  f"{run.per_cpu_second:,.0f} events per CPU-second of both{caveat}  "
                  f"[load {load}]")
            return run
        finally:
            for worker in workers:
                worker.stop()


def run(bootstrap: str, events: int, rate: float, seconds: float = 10.0,
        group_events: int | None = None) -> None:
    one_worker(bootstrap, events, rate, seconds)
    if group_events == 0:   # --no-group
        return
    two_workers(bootstrap, group_events if group_events is not None else 2 * events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small run (under a minute): ~42,000 events, 3 s of latency")
    parser.add_argument("--events", type=int, default=None,
                        help="backlog of (a), about (c) is twice as large; default 200000")
    parser.add_argument("--rate", type=float, default=5_000)
    parser.add_argument("--seconds", type=float, default=None,
                        help="seconds of paced appends for (b); default 10")
    parser.add_argument("--bootstrap", default="")
    parser.add_argument("--no-group", action="store_true",
                        help="skip (c), the two-worker run (for a latency or (a) run alone)")
    args = parser.parse_args()
    events = args.events or (60_000 if args.quick else 200_000)
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    group_events = 0 if args.no_group else events if args.quick else 2 * events
    if args.bootstrap:
        run(args.bootstrap, events, args.rate, seconds, group_events)
        return
    from dsh_dev.localstack.artifacts import Artifacts
    from dsh_dev.localstack.kafka import KafkaLocal
    with KafkaLocal(Artifacts.default().require_kafka()) as kafka:
        run(kafka.bootstrap, events, args.rate, seconds, group_events)


if __name__ == "__main__":
    main()
