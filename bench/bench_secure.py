"""The secure stack's cost: ingest and processors throughput, TLS + SCRAM-SHA-512 + ACLs against
plaintext, in one run (issue 16; target: secure >= 0.7x plaintext).

Usage: .venv/bin/python bench/bench_secure.py [--events 40000] [--rounds 2]

Two single-node brokers run side by side on this machine: a plaintext one and a secure one
(``dsh-pipeline broker --secure``'s configuration, without the registry); the rounds alternate
between them (plaintext, secure, plaintext, ...), each on a fresh topic prefix. On each:

- ingest: generated sessions (as bench_processors: chunks are most of the records), Avro
  encoded, published through one ``BulkProducer`` (the import path: idempotent, acks=all,
  whole batches) as the ingest principal; events per wall second of the publishing;
- processors: one ``dsh-pipeline processors`` worker (memory store, 3 partitions) as the
  processors principal folds that backlog; records per wall second between its first and its
  last record (polled on ``GET /health``).

Every round is printed with the load average; the machine is shared, so the ratio in one run
is the figure that matters.
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
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from processors_support import event_records, free_port, generated_sessions

from dsh_dev.localstack.artifacts import Artifacts
from dsh_dev.localstack.stack import LocalStack
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.topic_scan import BulkProducer
from pipeline.adapters.secure.acls import acl_plan
from pipeline.adapters.secure.security import SecureSetup, read_env_file
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
    launched = time.monotonic()
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
                # a backlog folded before the first sample (a small one) is timed from launch
                first = (now, count) if count < total else (launched, 0)
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
    ingest_rate = asyncio.run(_ingest(ingest, records))
    return ingest_rate, _fold_rate(stack, prefix, len(records), state)


async def _ingest(settings: Settings, records: list[OutRecord]) -> float:
    """Records per wall second through one BulkProducer (the import path: one connection,
    batches built whole), connection and authentication included."""
    began = time.monotonic()
    async with BulkProducer(settings) as out:
        for record in records:
            await out.send(record.topic, record.key, record.value, record.headers)
    return len(records) / (time.monotonic() - began)


def run(events: int, rounds: int, folder: Path,
        log: Callable[[str], None] = print) -> dict[str, list[float]]:
    """Both brokers started, then ``rounds`` rounds alternating plaintext and secure (a
    fresh topic prefix each): {"plain_ingest", "plain_fold", "secure_ingest",
    "secure_fold"} -> one value per round."""
    prefixes = [f"b{uuid.uuid4().hex[:8]}." for _ in range(rounds)]
    rules = [rule for prefix in prefixes for rule in acl_plan(
        Settings(topic_prefix=prefix, partitions=PARTITIONS, group_id_prefix="dsh-"))]
    stacks = {
        "plain": LocalStack(Artifacts.default(), with_registry=False,
                            workdir=folder / "plain" / "stack"),
        "secure": LocalStack(Artifacts.default(), with_registry=False,
                             security=SecureSetup.create(folder / "secure" / "run"),
                             acl_rules=rules, workdir=folder / "secure" / "stack"),
    }
    found: dict[str, list[float]] = {f"{n}_{w}": [] for n in stacks for w in ("ingest", "fold")}
    try:
        # The plaintext stack is its Kafka alone: launched first, it starts while the secure
        # one does (children are launched from this thread: their death signal follows it).
        stacks["plain"].kafka.launch()
        stacks["secure"].start(budget_s=300)
        stacks["plain"].kafka.wait_ready(300)
        for prefix in prefixes:
            for name, stack in stacks.items():
                ingest, fold = _round(stack, prefix, events, folder / name)
                found[f"{name}_ingest"].append(ingest)
                found[f"{name}_fold"].append(fold)
                log(f"{name}: ingest {ingest:,.0f} events/s, processors {fold:,.0f} records/s "
                    f"(load {os.getloadavg()[0]:.1f})")
    finally:
        for stack in stacks.values():
            stack.stop()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=40_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsh-bench-secure-") as tmp:
        found = run(args.events, args.rounds, Path(tmp))
    ingest = max(found["secure_ingest"]) / max(found["plain_ingest"])
    fold = max(found["secure_fold"]) / max(found["plain_fold"])
    print(f"secure/plaintext (best of each): ingest {ingest:.2f}x, processors {fold:.2f}x "
          "(target >= 0.7x)", flush=True)


if __name__ == "__main__":
    main()
