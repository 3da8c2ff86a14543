"""Benchmark: CPU per record of ``EventSerde.decode`` on the suite's mix (the decode half of
consume + decode, no broker), this checkout with its compiled decoder and with the generated
Python (``use_compiled_decoders``), against other checkouts, alternating in one run.

Each read is a child process started in its checkout's directory (so ``-c`` imports that
checkout's ``pipeline``): it encodes the mix's first ``--events`` events, decodes them once to
warm up, then ``--passes`` times, and prints the best pass in microseconds of CPU
(``time.process_time``) per record. A checkout without ``use_compiled_decoders`` runs as it is.

    .venv/bin/python bench/bench_decode.py [--events 50000] [--rounds 5] [--against /tmp/base]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from suite_core import load_average

CHECKOUT = Path(__file__).resolve().parent.parent
DECODE = """
import json, sys, time
sys.path.insert(0, "bench")
from suite_kafka import synth_mix
from pipeline.codec import binary
from pipeline.codec.avro import EventSerde

events, passes, variant = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if hasattr(binary, "use_compiled_decoders"):
    binary.use_compiled_decoders(variant == "compiled")
records = [EventSerde().encode(s, e) for s, e in synth_mix(events)[:events]]
decode = EventSerde().decode
for record in records:
    decode(record)
best = float("inf")
for _ in range(passes):
    started = time.process_time()
    for record in records:
        decode(record)
    best = min(best, time.process_time() - started)
print(json.dumps({"us_per_record": best / len(records) * 1e6}))
"""


def decode_with(checkout: Path, variant: str, events: int, passes: int) -> float:
    done = subprocess.run([sys.executable, "-c", DECODE, str(events), str(passes), variant],
                          cwd=checkout, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout.splitlines()[-1])["us_per_record"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", nargs="*", type=Path, default=[], metavar="CHECKOUT")
    args = parser.parse_args()
    runs = [(CHECKOUT, "compiled"), (CHECKOUT, "python"),
            *((path.resolve(), "as is") for path in args.against)]
    figures: dict[str, list[float]] = {f"{c} ({v})": [] for c, v in runs}
    loads = []
    for _ in range(args.rounds):
        loads.append(load_average())
        for checkout, variant in runs:
            figures[f"{checkout} ({variant})"].append(
                round(decode_with(checkout, variant, args.events, args.passes), 3))
    print(json.dumps({"events": args.events, "us_per_record": figures,
                      "load_before_rounds": loads, "load_after": load_average()}))


if __name__ == "__main__":
    main()
