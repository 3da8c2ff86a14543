"""Avro encode+decode throughput of session events on one core (issue 3, performance).

Usage: .venv/bin/python bench/bench_avro.py [--rounds N]

The event mix is every session of the fixtures (``../shared/fixtures/**/*.jsonl``, the logs dsh
recorded, read as :func:`read_session_file` reads them: packed chunk rows expanded, so
``assistant/chunk`` dominates as it does in real logs, about 58% of the events), in log
order, repeated 20 times; nothing is synthesized or reordered. Each round encodes every event
with :class:`EventSerde` (Event -> framed bytes) and decodes the bytes back (-> session id,
Event). Figures are events per CPU second of this process (time.process_time; on a shared
machine wall time would measure the neighbours), best of the rounds: encode alone, decode
alone, and the round trip (encode + decode time of the same round). Wall-clock round-trip
rates and the load average are printed beside them. fastavro's schemaless writer/reader on
the same records is printed as the reference.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import time
from dataclasses import dataclass
from pathlib import Path

from fastavro import schemaless_reader, schemaless_writer

from pipeline.codec.avro import EventSerde
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.events import Event

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


def load_mix() -> list[tuple[str, Event]]:
    mix = []
    for path in sorted(FIXTURES.glob("**/*.jsonl")):
        session = read_session_file(path)
        mix += [(session.session_id or path.stem, e) for e in session.events]
    return mix


@dataclass(frozen=True)
class Rates:
    """Best-of-rounds events/s: CPU time of encode, of decode, of both; wall time of both."""

    encode: float
    decode: float
    round_trip: float
    round_trip_wall: float


def measure(mix: list[tuple[str, Event]], serde: EventSerde, rounds: int) -> Rates:
    best_encode = best_decode = best_both = best_wall = float("inf")
    encode, decode = serde.encode, serde.decode
    for _ in range(rounds):
        wall = time.perf_counter()
        start = time.process_time()
        blobs = [encode(session_id, event) for session_id, event in mix]
        encoded = time.process_time()
        for blob in blobs:
            decode(blob)
        decoded = time.process_time()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_encode = min(best_encode, encoded - start)
        best_decode = min(best_decode, decoded - encoded)
        best_both = min(best_both, decoded - start)
    n = len(mix)
    return Rates(n / best_encode, n / best_decode, n / best_both, n / best_wall)


def best_rate(mix: list[tuple[str, Event]], serde: EventSerde, rounds: int) -> float:
    """Round trips (encode + decode) per CPU second, best of the rounds."""
    return measure(mix, serde, rounds).round_trip


def fastavro_rate(mix: list[tuple[str, Event]], serde: EventSerde, rounds: int) -> float:
    parsed = serde.writer.parsed
    records = [serde.records.to_record(s, e) for s, e in mix]
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        blobs = []
        for record in records:
            out = io.BytesIO()
            schemaless_writer(out, parsed, record)
            blobs.append(out.getvalue())
        for blob in blobs:
            schemaless_reader(io.BytesIO(blob), parsed, None, return_record_name=True,
                              return_record_name_override=True)
        best = min(best, time.process_time() - start)
    return len(mix) / best


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    mix = load_mix() * 20
    counts = collections.Counter(e.type for _, e in mix)
    share = counts["assistant/chunk"] / len(mix)
    print(f"mix: {len(mix)} events, {len(counts)} types, assistant/chunk {share:.0%}; {_load()}")
    for name, serde in (("single-object", EventSerde()),
                        ("confluent", EventSerde(schema_id=1))):
        r = measure(mix, serde, args.rounds)
        print(f"EventSerde {name:13s} events/s (CPU): encode {r.encode:,.0f}  decode "
              f"{r.decode:,.0f}  encode+decode {r.round_trip:,.0f}  (wall: encode+decode "
              f"{r.round_trip_wall:,.0f}); {_load()}")
    chunks = [(s, e) for s, e in mix if e.type == "assistant/chunk"]
    rate = best_rate(chunks, EventSerde(), args.rounds)
    print(f"EventSerde single-object, assistant/chunk only, encode+decode: {rate:,.0f} events/s")
    reference = fastavro_rate(mix, EventSerde(), max(3, args.rounds // 5))
    print(f"fastavro schemaless writer+reader (records only, reference): "
          f"{reference:,.0f} events/s; {_load()}")


if __name__ == "__main__":
    main()
