"""The secure stack's cost: ingest and processors throughput, TLS + SCRAM-SHA-512 + ACLs against
plaintext, in one run (issue 16; target: secure >= 0.7x plaintext).

Usage: .venv/bin/python bench/bench_secure.py [--events 40000] [--rounds 2]

Two single-node brokers are started one after the other on this machine: a plaintext one and a
secure one (``dsh-pipeline broker --secure``'s configuration, without the registry). On each:

- ingest: generated sessions (as bench_processors: chunks are most of the records), Avro
  encoded, published with ``send_records`` (idempotent, acks=all, 5,000 per call) as the
  ingest principal; events per wall second of the publishing;
- processors: one ``dsh-pipeline processors`` worker (memory store, 3 partitions) as the
  processors principal folds that backlog; records per wall second between its first and its
  last record (polled on ``GET /health``).

Each figure is the best of ``--rounds`` (a fresh topic prefix each), printed with the load
average; the machine is shared, so the ratio in one run is the figure that matters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from processors_support import event_records, free_port, generated_sessions

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.localstack.acls import acl_plan
from pipeline.adapters.localstack.artifacts import Artifacts
from pipeline.adapters.localstack.security import SecureSetup, read_env_file
from pipeline.adapters.localstack.stack import LocalStack
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PARTITIONS = 3


def _settings(stack: LocalStack, role: str, prefix: str) -> Settings:
    base = Settings(bootstrap_servers=stack.bootstrap, topic_prefix=prefix,
                    partitions=PARTITIONS, group_id_prefix="dsh-")
    if stack.security is None:
        return base
    return Settings.from_env({**base.to_env(), **read_env_file(
        stack.security.env_file(role)), "DSH_REGISTRY_URL": base.registry_url})


def _handled(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
        return int(json.loads(response.read())["counters"]["records"])


def _fold_rate(stack: LocalStack, prefix: str, total: int, state: Path) -> float:
    settings = _settings(stack, "processors", prefix)
    port = free_port()
    env = {**os.environ, **settings.to_env(), "DSH_STATE_DIR": str(state)}
    log = (state / f"worker-{port}.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "processors",
                             "--web-port", str(port), "--loglevel", "warning"], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        first: tuple[float, int] | None = None
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"worker exited {proc.returncode}; see {log.name}")
            try:
                count = _handled(port)
            except OSError:
                count = 0
            now = time.monotonic()
            if first is None and count > 0:
                first = (now, count)
            if first is not None and count >= total:
                return (count - first[1]) / max(now - first[0], 1e-9)
            time.sleep(0.2)
        raise SystemExit("the worker did not fold the backlog in 900 s")
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def _round(stack: LocalStack, prefix: str, events: int, state: Path) -> tuple[float, float]:
    admin = _settings(stack, "admin", prefix)
    asyncio.run(ensure_topics(admin))
    sessions = generated_sessions(7, max(1, events // 260), prefix.rstrip("."), ["m1", "m2"],
                                  int(time.time() * 1000), max_chunks=60)
    ingest = _settings(stack, "ingest", prefix)
    records = [r for sid, evs in sessions.items() for r in event_records(ingest, sid, evs)]
    began = time.monotonic()
    for start in range(0, len(records), 5000):
        asyncio.run(send_records(ingest, records[start:start + 5000]))
    ingest_rate = len(records) / (time.monotonic() - began)
    return ingest_rate, _fold_rate(stack, prefix, len(records), state)


def measure(secure: bool, events: int, rounds: int, folder: Path) -> tuple[float, float]:
    """(best ingest events/s, best processors records/s) over ``rounds`` fresh prefixes."""
    prefixes = [f"b{uuid.uuid4().hex[:8]}." for _ in range(rounds)]
    rules = [rule for prefix in prefixes for rule in acl_plan(
        Settings(topic_prefix=prefix, partitions=PARTITIONS, group_id_prefix="dsh-"))]
    security = SecureSetup.create(folder / "run") if secure else None
    stack = LocalStack(Artifacts.default(), with_registry=False, security=security,
                       acl_rules=rules, workdir=folder / "stack")
    stack.start(budget_s=300)
    try:
        results = [_round(stack, prefix, events, folder) for prefix in prefixes]
    finally:
        stack.stop()
    return max(r[0] for r in results), max(r[1] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=40_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsh-bench-secure-") as tmp:
        figures = {}
        for secure in (False, True):
            load = os.getloadavg()[0]
            ingest, fold = measure(secure, args.events, args.rounds,
                                   Path(tmp) / ("secure" if secure else "plain"))
            name = "secure" if secure else "plaintext"
            figures[name] = (ingest, fold)
            print(f"{name}: ingest {ingest:,.0f} events/s, processors {fold:,.0f} records/s "
                  f"(load {load:.1f})", flush=True)
        plain, safe = figures["plaintext"], figures["secure"]
        print(f"secure/plaintext: ingest {safe[0] / plain[0]:.2f}x, processors "
              f"{safe[1] / plain[1]:.2f}x (target >= 0.7x)", flush=True)


if __name__ == "__main__":
    main()
