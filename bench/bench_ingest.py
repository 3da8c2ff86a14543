"""Benchmark: ingest (the suite's ``ingest_ours``: Avro encode + headers + BulkProducer,
idempotent, acks=all) of this checkout against other checkouts, A/B in one run, with the
suite's plain aiokafka + JSON producer (``ingest_json``) and Kafka's ProducerPerformance
(same count, the mix's mean Avro record size, a fresh topic) as the anchors of each round.

Each round runs every checkout's ``ingest_ours`` in turn (a child process started in that
checkout's directory, so ``-c`` imports its ``pipeline`` and its ``bench/suite_kafka``), then
the anchors, each writing the same synthetic events to a fresh topic. Each child prints
events/s (wall, first send to last acknowledgement) and its CPU seconds for the write
(topic creation and producer start included, the same in every child).

    DSH_CACHE_DIR=/work/main/.cache .venv/bin/python bench/bench_ingest.py \\
        --bootstrap 127.0.0.1:19092 [--events 100000] [--rounds 3] [--against /tmp/base]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

from suite_core import ab_arguments, load_average
from suite_kafka import fresh_topic, mean_avro_size, synth_mix
from suite_tools import producer_performance, tools_lib

from pipeline.settings import Settings

CHECKOUT = Path(__file__).resolve().parent.parent
# Run in the child, against the checkout's own code.
WRITE = """
import asyncio, json, sys, time
sys.path.insert(0, "bench")
import suite_kafka
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.settings import Settings

bootstrap, prefix, events, which = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
settings = Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                             partitions=6, replication_factor=1)
mix = list(suite_kafka.synth_mix(events))
asyncio.run(ensure_topics(settings))
cpu = time.process_time()
rate = asyncio.run(getattr(suite_kafka, which)(settings, mix))
print(json.dumps({"events_per_s": rate, "cpu_s": time.process_time() - cpu}))
"""


def write_with(checkout: Path, bootstrap: str, events: int, which: str) -> dict[str, float]:
    prefix = f"ingest{uuid.uuid4().hex[:8]}."
    done = subprocess.run([sys.executable, "-c", WRITE, bootstrap, prefix, str(events), which],
                          cwd=checkout, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def producer_performance_once(bootstrap: str, events: int, size: int) -> float:
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, partitions=6,
                                 replication_factor=1,
                                 topic_prefix=f"ingest{uuid.uuid4().hex[:8]}.")
    topic = f"{settings.topic_prefix}pp-anchor"
    asyncio.run(fresh_topic(settings, topic))
    lib = tools_lib()
    assert lib is not None, "Kafka's tools are not cached: export DSH_CACHE_DIR"
    return producer_performance(lib, bootstrap, topic, events, size)


def main() -> None:
    args = ab_arguments(__doc__.split("\n\n")[0]).parse_args()
    checkouts = [CHECKOUT, *(path.resolve() for path in args.against)]
    runs: dict[str, list[dict[str, float]]] = {str(c): [] for c in checkouts}
    anchor: list[float] = []
    java: list[float] = []
    size = mean_avro_size(list(synth_mix(args.events)))
    loads = []
    for _ in range(args.rounds):
        loads.append(load_average())
        for checkout in checkouts:
            runs[str(checkout)].append(write_with(checkout, args.bootstrap, args.events,
                                                  "ingest_ours"))
        anchor.append(write_with(CHECKOUT, args.bootstrap, args.events,
                                 "ingest_json")["events_per_s"])
        java.append(producer_performance_once(args.bootstrap, args.events, size))
    summary = {}
    for checkout, measured in runs.items():
        ratios = [m["events_per_s"] / a for m, a in zip(measured, anchor, strict=True)]
        to_java = [m["events_per_s"] / a for m, a in zip(measured, java, strict=True)]
        summary[checkout] = {
            "events_per_s": [round(m["events_per_s"]) for m in measured],
            "cpu_s": [round(m["cpu_s"], 2) for m in measured],
            "ratio_to_json_per_round": [round(r, 2) for r in ratios],
            "median_ratio": round(statistics.median(ratios), 2),
            "ratio_to_producer_performance_per_round": [round(r, 2) for r in to_java],
            "median_ratio_to_producer_performance": round(statistics.median(to_java), 2)}
    print(json.dumps({"events": args.events, "checkouts": summary,
                      "aiokafka_json": [round(a) for a in anchor],
                      "producer_performance": [round(a) for a in java],
                      "mean_avro_record_bytes": size,
                      "load_before_rounds": loads, "load_after": load_average()}))


if __name__ == "__main__":
    main()
