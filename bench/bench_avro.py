"""Avro encode+decode throughput of session events on one core (issue 3, performance).

Usage: .venv/bin/python bench/bench_avro.py [--rounds N]

The event mix is the fixtures' sessions as dsh recorded them (packed chunk rows expanded, so
``assistant/chunk`` dominates as it does in real logs). Each round encodes every event with
:class:`EventSerde` and decodes the bytes back; the figure is events / (encode + decode
time), best of the rounds, in CPU time of this process (on a shared machine wall time would
measure the neighbours). fastavro's schemaless writer/reader on the same records is printed
as the reference.
"""

from __future__ import annotations

import argparse
import collections
import io
import time
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


def best_rate(mix: list[tuple[str, Event]], serde: EventSerde, rounds: int) -> float:
    best = float("inf")
    encode, decode = serde.encode, serde.decode
    for _ in range(rounds):
        start = time.process_time()
        blobs = [encode(session_id, event) for session_id, event in mix]
        for blob in blobs:
            decode(blob)
        best = min(best, time.process_time() - start)
    return len(mix) / best


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    mix = load_mix() * 20
    counts = collections.Counter(e.type for _, e in mix)
    share = counts["assistant/chunk"] / len(mix)
    print(f"mix: {len(mix)} events, {len(counts)} types, assistant/chunk {share:.0%}")
    for name, serde in (("single-object", EventSerde()),
                        ("confluent", EventSerde(schema_id=1))):
        rate = best_rate(mix, serde, args.rounds)
        print(f"EventSerde {name:13s} encode+decode: {rate:,.0f} events/s")
    chunks = [(s, e) for s, e in mix if e.type == "assistant/chunk"]
    rate = best_rate(chunks, EventSerde(), args.rounds)
    print(f"EventSerde single-object, assistant/chunk only: {rate:,.0f} events/s")
    reference = fastavro_rate(mix, EventSerde(), max(3, args.rounds // 5))
    print(f"fastavro schemaless writer+reader (records only, reference): "
          f"{reference:,.0f} events/s")


if __name__ == "__main__":
    main()
