"""A/B of the driver's commit settings in one run, against anchors measured in that run.

Runs bench_driver_kafka's benchmark for each variant in turn, ``--rounds`` times
interleaved (A, B, C, D, A, B, ...), so that every variant sees the same load, and prints
one JSON line per run and a summary per variant: the WORST p99 of its rounds and the
spread. The anchor is a bare transaction (one record plus an inbox offset, begin to
commit) timed in each round on the same broker: what one commit costs on this machine now.

    .venv/bin/python bench/bench_driver_ab.py --bootstrap HOST:PORT [--rounds 3] [--paced]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.structs import TopicPartition
from bench_driver_kafka import Pacing, run

from pipeline.adapters.kafka.topic_scan import ensure_topic
from pipeline.settings import Settings

VARIANTS: dict[str, dict[str, Any]] = {  # name: keyword arguments of bench_driver_kafka.run
    "unbounded": {"steps_per_transaction": 0},
    "8 steps per transaction": {"steps_per_transaction": 8},
    "8 per transaction, refilled only when nothing is buffered": {
        "steps_per_transaction": 8, "refill_below": 1},
    "16 steps per transaction": {"steps_per_transaction": 16},
    "32 steps per transaction": {"steps_per_transaction": 32},
    "pipelined steps, no budget": {"steps_per_transaction": 0, "pipelined": True},
    "4 steps per transaction": {"steps_per_transaction": 4},
    "2 steps per transaction": {"steps_per_transaction": 2},
    "8 per transaction, linger 5 ms": {"steps_per_transaction": 8, "linger_ms": 5.0},
    "4 per transaction, 12 partitions": {"steps_per_transaction": 4, "partitions": 12},
    "8 per transaction, reader on the driver's loop": {"steps_per_transaction": 8,
                                                        "reader_in_process": True},
}
PACED = Pacing(ramp_s=2.0, first_token_ms=300, chunk_ms=30)


async def bare_transactions(bootstrap: str, count: int = 30) -> list[float]:
    """ms per transaction of one 130-byte record plus an offset commit."""
    name = f"anchor{uuid.uuid4().hex[:8]}"
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, partitions=1,
                                 replication_factor=1)
    for topic in (f"{name}.out", f"{name}.in"):
        await ensure_topic(settings, topic, compact=False)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=name,
                                enable_idempotence=True, acks="all", linger_ms=0)
    await producer.start()
    took = []
    try:
        for index in range(count):
            started = time.perf_counter()
            await producer.begin_transaction()
            await producer.send_and_wait(f"{name}.out", b"x" * 130, partition=0)
            await producer.send_offsets_to_transaction(
                {TopicPartition(f"{name}.in", 0): index}, f"{name}.g")
            await producer.commit_transaction()
            took.append((time.perf_counter() - started) * 1000)
    finally:
        await producer.stop()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--paced", action="store_true", help=f"paced load: {PACED}")
    parser.add_argument("--only", nargs="+", help="variants whose name contains a word")
    args = parser.parse_args()
    pacing = PACED if args.paced else Pacing()
    asyncio.run(run(args.bootstrap, 5, 6, 25.0))  # the broker's transaction topics exist
    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    anchors: list[float] = []
    for round_ in range(args.rounds):
        bare = asyncio.run(bare_transactions(args.bootstrap))
        anchors.append(statistics.quantiles(bare, n=100)[98])
        for name, options in VARIANTS.items():
            if args.only and not any(word in name for word in args.only):
                continue
            chosen = dict(options)
            partitions, linger_ms = chosen.pop("partitions", 6), chosen.pop("linger_ms", 25.0)
            result = asyncio.run(run(args.bootstrap, args.sessions, partitions, linger_ms,
                                     pacing=pacing, **chosen))
            results[name].append(result)
            print(json.dumps({"round": round_ + 1, "variant": name, **result}), flush=True)
    print(json.dumps({"anchor": "bare transaction p99 ms", "values": anchors}))
    for name, runs in results.items():
        if not runs:
            continue
        p99 = [r["visible_ms_p99"] for r in runs]
        steps = [r["steps_per_s"] for r in runs]
        print(json.dumps({"variant": name, "worst_p99_ms": max(p99), "p99_spread": p99,
                          "worst_steps_per_s": min(steps), "steps_spread": steps,
                          "claimed_ms_p99": [r.get("claimed_ms_p99") for r in runs],
                          "invalid_logs": sum(r["invalid_logs"] for r in runs)}))


if __name__ == "__main__":
    main()
