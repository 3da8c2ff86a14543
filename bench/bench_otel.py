"""``dsh-pipeline otel``: export rate in events per CPU-second, against the processors'.

Usage: .venv/bin/python bench/bench_otel.py [--quick] [--events 200000] [--bootstrap HOST:PORT]
       (default: start a local single-node Kafka)

One backlog of generated sessions (bench_processors.make_sessions: ~80% chunks) on a fresh
topic set, then, in the same run and one after the other (so neither steals the other's
CPU on this 2-core machine):

(a) one processors worker folds it (bench_processors.throughput: records per wall second
    and per CPU-second of the worker process);
(b) one ``dsh-pipeline otel`` process exports it to a local OTLP/HTTP receiver (aiohttp in
    this process, decoding every request with opentelemetry-proto): the records it read
    (its /health ``offsets_read``) between its first and its last poll with progress, per
    wall second and per CPU-second of the otel process (user + system, /proc), until every
    ended turn of the backlog was acknowledged.

Both read every record of the topic; the otel service decodes only the span types (the
chunks are skipped by their header), the processors fold everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_processors
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from processors_support import Worker, free_port

from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


class Receiver:
    """An OTLP/HTTP receiver on its own thread and loop; counts spans and turns."""

    def __init__(self) -> None:
        self.spans = 0
        self.turns = 0
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _traces(self, request: web.Request) -> web.Response:
        decoded = ExportTraceServiceRequest()
        decoded.ParseFromString(await request.read())
        for rs in decoded.resource_spans:
            for ss in rs.scope_spans:
                self.spans += len(ss.spans)
                self.turns += sum(1 for s in ss.spans if s.name == "invoke_agent")
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")


def health(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
        found: dict[str, Any] = json.loads(answer.read())
        return found


def export_rate(settings: Settings, total: int, turns: int) -> tuple[float, float, float]:
    """(records per wall second, wall seconds, records per otel CPU-second)."""
    receiver = Receiver()
    port = free_port()
    env = {**os.environ, **settings.to_env(),
           "DSH_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli.main", "otel", "--start", "beginning",
         "--metrics-port", str(port), "--log-level", "warning"], cwd=ROOT, env=env)
    try:
        first: tuple[float, int, float] | None = None
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"dsh-pipeline otel exited with {proc.returncode}")
            try:
                read = int(health(port)["offsets_read"])
            except OSError:
                time.sleep(0.2)
                continue
            now, cpu = time.monotonic(), bench_processors.cpu_seconds(proc.pid)
            if first is None and read > 0:
                first = (now, read, cpu)
            if first is not None and read >= total and receiver.turns >= turns:
                done = read - first[1]
                return (done / max(now - first[0], 1e-9), now - first[0],
                        done / max(cpu - first[2], 1e-9))
            time.sleep(0.2)
        raise SystemExit(f"otel did not finish: {receiver.turns} of {turns} turns")
    finally:
        proc.terminate()
        proc.wait(30)


def run(bootstrap: str, events: int) -> dict[str, float]:
    settings = bench_processors.fresh_settings(bootstrap, "o")
    sessions = bench_processors.make_sessions(1, events, "to")
    total = asyncio.run(bench_processors.publish(settings, sessions))
    turns = sum(1 for es in sessions.values() for e in es if e.type == "turn/end")
    print(f"published {total} events, {turns} ended turns, in {len(sessions)} sessions")
    with tempfile.TemporaryDirectory() as state:
        worker = Worker(settings, free_port(), Path(state), ["--log-level", "warning"])
        try:
            worker.wait_ready()
            load = bench_processors.load_average()
            p_rate, p_took, p_cpu = bench_processors.throughput(worker, total)
        finally:
            worker.stop()
    print(f"(a) processors: {p_rate:,.0f} events/s wall ({p_took:.1f} s), {p_cpu:,.0f} "
          f"events per worker CPU-second  [load {load}]")
    load = bench_processors.load_average()
    o_rate, o_took, o_cpu = export_rate(settings, total, turns)
    print(f"(b) otel export: {o_rate:,.0f} events/s wall ({o_took:.1f} s), {o_cpu:,.0f} "
          f"events per otel CPU-second ({o_cpu / p_cpu:.1f}x the processors')  [load {load}]")
    return {"processors_events_per_cpu_s": p_cpu, "otel_events_per_cpu_s": o_cpu,
            "processors_events_per_s": p_rate, "otel_events_per_s": o_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 40,000-event backlog")
    parser.add_argument("--events", type=int, default=None, help="default 200000")
    parser.add_argument("--bootstrap", default="")
    args = parser.parse_args()
    events = args.events or (40_000 if args.quick else 200_000)
    if args.bootstrap:
        run(args.bootstrap, events)
        return
    from dsh_dev.localstack.artifacts import Artifacts
    from dsh_dev.localstack.kafka import KafkaLocal
    with KafkaLocal(Artifacts.default().require_kafka()) as kafka:
        run(kafka.bootstrap, events)


if __name__ == "__main__":
    main()
