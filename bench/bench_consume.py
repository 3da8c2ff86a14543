"""Benchmark: consume + decode (each checkout's own ``bench/suite_kafka.consume_ours``:
``TopicScan`` + ``EventSerde.decode`` of every record, the suite's ``ingest`` section's figure)
of this checkout against other checkouts, A/B in one run, with Kafka's ConsumerPerformance
on the same topic as the anchor of each round.

One topic of the suite's synthetic mix is written once; then each round reads it with every
checkout in turn (a child process started in that checkout's directory, so ``-c`` imports
its ``pipeline`` and ``bench/suite_kafka``), then with ConsumerPerformance. Each read prints
events/s (wall, from the first fetch to the last record) and the child's CPU seconds.

    DSH_CACHE_DIR=/work/main/.cache .venv/bin/python bench/bench_consume.py \\
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
from suite_kafka import ingest_ours, synth_mix
from suite_tools import consumer_performance, tools_lib

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.settings import Settings

CHECKOUT = Path(__file__).resolve().parent.parent
# Run in the child, against the checkout's own code.
READ = """
import asyncio, json, sys, time
sys.path.insert(0, "bench")
from suite_kafka import consume_ours
from pipeline.settings import Settings

bootstrap, prefix, expected = sys.argv[1], sys.argv[2], int(sys.argv[3])
settings = Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                             partitions=6, replication_factor=1)
cpu = time.process_time()
rate = asyncio.run(consume_ours(settings, expected))
print(json.dumps({"events_per_s": rate, "cpu_s": time.process_time() - cpu}))
"""


def read_with(checkout: Path, bootstrap: str, prefix: str, expected: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", READ, bootstrap, prefix, str(expected)],
                          cwd=checkout, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> None:
    args = ab_arguments(__doc__.split("\n\n")[0]).parse_args()
    prefix = f"consume{uuid.uuid4().hex[:8]}."
    settings = Settings.from_env({}, bootstrap_servers=args.bootstrap, topic_prefix=prefix,
                                 partitions=6, replication_factor=1)
    mix = list(synth_mix(args.events))
    asyncio.run(ensure_topics(settings))
    asyncio.run(ingest_ours(settings, mix))
    checkouts = [CHECKOUT, *(path.resolve() for path in args.against)]
    runs: dict[str, list[dict[str, float]]] = {str(c): [] for c in checkouts}
    anchor: list[float] = []
    loads = []
    lib = tools_lib()
    for _ in range(args.rounds):
        loads.append(load_average())
        for checkout in checkouts:
            runs[str(checkout)].append(read_with(checkout, args.bootstrap, prefix, len(mix)))
        anchor.append(consumer_performance(lib, args.bootstrap,
                                           settings.topics.session_events, len(mix)))
    summary = {}
    for checkout, measured in runs.items():
        ratios = [m["events_per_s"] / a for m, a in zip(measured, anchor, strict=True)]
        summary[checkout] = {
            "events_per_s": [round(m["events_per_s"]) for m in measured],
            "cpu_s": [round(m["cpu_s"], 2) for m in measured],
            "ratio_to_anchor_per_round": [round(r, 2) for r in ratios],
            "median_ratio": round(statistics.median(ratios), 2)}
    print(json.dumps({"events": len(mix), "checkouts": summary,
                      "consumer_performance": [round(a) for a in anchor],
                      "load_before_rounds": loads, "load_after": load_average()}))


if __name__ == "__main__":
    main()
