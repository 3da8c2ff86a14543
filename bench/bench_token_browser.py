"""Benchmark: token -> browser, a chunk appended by the driver -> the SSE event on its session
page's stream, with many sessions streaming at once (issue 21).

Three processes besides the broker, as deployed: a ``dsh-pipeline driver`` (the scripted
provider: the echo reply, one chunk every ``--chunk-delay-ms``), a ``dsh-pipeline
dashboard``, and this one, the reader: ``--watchers`` SSE clients, each on one session's
page stream (``/api/stream/sessions/{id}``), opened (and caught up) before the follow-ups
are sent, a few at a time: opening a page reads its snapshot with consumers of its own.
Then one follow-up per session (``--sessions``) goes to the inbox at once and the driver
streams every session's turn at the same time.

For every ``assistant/chunk`` a watcher receives, the figure is its arrival minus the chunk's
``time`` (stamped by the driver's runner when it was appended; one machine, one clock).
Where the time goes: a plain read_committed consumer in this process notes when each chunk
of the watched sessions became readable, so ``readable_ms`` (appended -> readable: the
driver's transactions) and ``to_browser_ms`` (readable -> SSE event: the dashboard's tail,
its hub and the stream) split the total. ``dashboard_cpu_s``/``driver_cpu_s``: the two
processes' CPU seconds from the first follow-up sent to the last watched turn's end
(``elapsed_s``): near ``elapsed_s``, a process was CPU-bound. Processors are not running: the
watched sessions are new, so their pages start from the live tail (basis ``live``).

    .venv/bin/python bench/bench_token_browser.py --bootstrap HOST:PORT [--sessions 1000]
        [--watchers 20] [--chunk-delay-ms 100]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiokafka import AIOKafkaConsumer
from processes import cpu_seconds, stop

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.codec.records import HEADER_TYPE
from pipeline.core.inbox import FollowUp
from pipeline.settings import Settings

CHECKOUT = Path(__file__).resolve().parents[1]
CHUNK = b"assistant/chunk"
OPEN_AT_ONCE = 5  # session pages opened together (each reads its snapshot with consumers)
OPEN_TIMEOUT_S = 180.0


def percentiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (0.0, 0.0)
    cuts = statistics.quantiles(values, n=100)
    return round(cuts[49], 1), round(cuts[98], 1)


@contextmanager
def process(argv: list[str], env: dict[str, str], ready: str) -> Iterator[tuple[str, int]]:
    """A ``dsh-pipeline`` child process; yields its first stdout line starting ``ready``,
    and its pid."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", *argv], cwd=CHECKOUT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and not line.startswith(ready):
            line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{argv[0]} exited early ({proc.wait()})")
        yield line.strip(), proc.pid
    finally:
        stop(proc)



def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "health", timeout=5) as response:
                if json.loads(response.read()).get("ready"):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError("the dashboard was not ready")


class Watcher:
    """One session page's SSE stream: arrival time of each chunk event, by seq."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.caught_up = asyncio.Event()
        self.ended = asyncio.Event()
        self.chunks: dict[int, tuple[float, float]] = {}  # seq -> (appended ms, arrived ms)
        self.error: str | None = None

    async def run(self, http: aiohttp.ClientSession, url: str) -> None:
        async with http.get(f"{url}api/stream/sessions/{self.session_id}") as response:
            name = b""
            async for raw in response.content:
                if raw.startswith(b"event:"):
                    name = raw[6:].strip()
                elif raw.startswith(b"data:"):
                    self._message(name, raw[5:])
                    if self.ended.is_set():
                        return

    def _message(self, name: bytes, data: bytes) -> None:
        if name == b"caught-up":
            self.caught_up.set()
        elif name == b"stream-error":
            self.error = data.decode()
            self.caught_up.set()
            self.ended.set()
        elif name == b"event":
            arrived = time.time() * 1000
            event: dict[str, Any] = json.loads(data)
            if event["type"] == "assistant/chunk":
                self.chunks[event["seq"]] = (float(event["time"]), arrived)
            elif event["type"] == "turn/end":
                self.ended.set()


async def note_readable(settings: Settings, watched: set[str], stop: asyncio.Event
                        ) -> dict[tuple[str, int], float]:
    """When each chunk of a watched session became readable (read_committed), by (session,
    seq): a plain consumer, which decodes only the watched sessions' chunks."""
    serde = EventSerde()
    consumer = AIOKafkaConsumer(settings.topics.session_events, **client_options(settings),
                                group_id=None, isolation_level="read_committed",
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                fetch_max_wait_ms=100)
    await consumer.start()
    readable: dict[tuple[str, int], float] = {}
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=100, max_records=5000)
            now_ms = time.time() * 1000
            for records in batch.values():
                for record in records:
                    key = record.key.decode() if record.key else ""
                    if key in watched and (HEADER_TYPE, CHUNK) in record.headers:
                        session_id, event = serde.decode(record.value)
                        readable[(session_id, event.seq)] = now_ms
    finally:
        await consumer.stop()
    return readable


async def measure(settings: Settings, url: str, sessions: int, watchers: int,
                  timeout_s: float, pids: dict[str, int]) -> dict[str, float]:
    ids = [f"s{n}" for n in range(sessions)]
    watched = [Watcher(ids[i * sessions // watchers]) for i in range(watchers)]
    stop = asyncio.Event()
    reference = asyncio.create_task(note_readable(settings, {w.session_id for w in watched},
                                                  stop))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        streams = []
        for group in range(0, len(watched), OPEN_AT_ONCE):  # a page open costs consumers
            opening = watched[group:group + OPEN_AT_ONCE]
            streams += [asyncio.create_task(w.run(http, url)) for w in opening]
            await asyncio.wait_for(asyncio.gather(*(w.caught_up.wait() for w in opening)),
                                   OPEN_TIMEOUT_S)
        errors = [w.error for w in watched if w.error is not None]
        if errors:
            raise RuntimeError(f"{len(errors)} session streams failed: {errors[0]}")
        codec = InboxCodec()
        records = [OutRecord(settings.topics.inbox, sid.encode(), codec.encode(
            FollowUp(sid, f"m-{sid}", ({"type": "text", "text": f"ping {sid}"},))))
            for sid in ids]
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        started = time.perf_counter()
        await send_records(settings, records)
        done, _ = await asyncio.wait([asyncio.create_task(w.ended.wait()) for w in watched],
                                     timeout=timeout_s)
        elapsed = time.perf_counter() - started
        cpu = {f"{name}_cpu_s": round(cpu_seconds(pid) - cpu_before[name], 2)
               for name, pid in pids.items()}
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    stop.set()
    readable = await reference
    return {**summarize(watched, readable, len(done), elapsed), **cpu}


def summarize(watched: list[Watcher], readable: dict[tuple[str, int], float], ended: int,
              elapsed: float) -> dict[str, float]:
    total, to_readable, to_browser = [], [], []
    for watcher in watched:
        for seq, (appended, arrived) in watcher.chunks.items():
            total.append(arrived - appended)
            seen = readable.get((watcher.session_id, seq))
            if seen is not None:
                to_readable.append(seen - appended)
                to_browser.append(arrived - seen)
    p50, p99 = percentiles(total)
    r50, r99 = percentiles(to_readable)
    b50, b99 = percentiles(to_browser)
    return {"chunks": len(total), "watchers_ended": ended, "elapsed_s": round(elapsed, 2),
            "browser_ms_p50": p50, "browser_ms_p99": p99,
            "readable_ms_p50": r50, "readable_ms_p99": r99,
            "to_browser_ms_p50": b50, "to_browser_ms_p99": b99}


def run(bootstrap: str, sessions: int = 1000, watchers: int = 20,
        chunk_delay_ms: int = 100, partitions: int = 6,
        driver_options: tuple[str, ...] = ()) -> dict[str, float]:
    """One measurement on fresh topics: a driver and a dashboard process, then the SSE
    clients; returns the figures (ms), with the load average at the start."""
    prefix = f"bench{uuid.uuid4().hex[:8]}."
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                                 partitions=partitions, replication_factor=1,
                                 group_id_prefix=f"{prefix}g-")
    asyncio.run(ensure_topics(settings))
    env = {**os.environ, **settings.to_env(), "DSH_DASHBOARD_PORT": "0",
           "DSH_DASHBOARD_HOST": "127.0.0.1"}
    load = os.getloadavg()[0]
    with process(["dashboard"], env, "dashboard: http") as (line, dashboard):
        url = line.split()[-1]
        wait_ready(url)
        with process(["driver", "--script", "echo", "--script-chunk-delay-ms",
                      str(chunk_delay_ms), "--port", "-1", "--max-turns", str(sessions + 1),
                      *driver_options], env, "ready") as (_, driver):
            gc.freeze()  # the reader's own full collections (the suite's heap) are not latency
            try:
                result = asyncio.run(measure(settings, url, sessions, watchers,
                                             timeout_s=120.0,
                                             pids={"dashboard": dashboard, "driver": driver}))
            finally:
                gc.unfreeze()
    return {**result, "sessions": sessions, "watchers": watchers,
            "chunk_delay_ms": chunk_delay_ms, "load": round(load, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--watchers", type=int, default=20)
    parser.add_argument("--chunk-delay-ms", type=int, default=100)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.runs):
        print(json.dumps(run(args.bootstrap, args.sessions, args.watchers,
                             args.chunk_delay_ms)), flush=True)


if __name__ == "__main__":
    main()
