"""Import benchmark: ``dsh-pipeline import`` of an archive of dsh session files (issue 22).

100 synthetic sessions of 1,000 events each (:mod:`dsh_dev.synth`, the fixtures' mix),
written as dsh writes them (packed rows) once, outside the timed part. Each run imports
them into fresh topics with :class:`~pipeline.services.replay.transfer.Importer` (what the
command runs: read and check every file, read what the topic holds, publish in batched
transactions). The anchor is the ingest benchmark's producer path (Avro encode + idempotent
producer) on the same 100,000 events, measured in the same run.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from suite_core import Context, Figure
from suite_kafka import ingest_ours

from dsh_dev.synth import synth_session
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.codec.avro import EventSerde
from pipeline.codec.sessionfile import write_session_file
from pipeline.services.replay.prepare import avro_encoder, default_workers
from pipeline.services.replay.transfer import Importer
from pipeline.settings import Settings


def write_archive(folder: Path, sessions: int, events: int) -> list[Path]:
    """``sessions`` dsh session files of ``events`` events each, one folder per session."""
    paths = []
    for seed in range(sessions):
        path = folder / f"import-{seed:03d}" / "session.jsonl"
        path.parent.mkdir(parents=True)
        write_session_file(path, synth_session(seed, events), packed=True,
                           header={"type": "session", "version": 0, "id": f"import-{seed:03d}"})
        paths.append(path)
    return paths


async def import_rate(settings: Settings, paths: list[Path], expected: int) -> float:
    """events/s of one import of ``paths`` into fresh topics."""
    await ensure_topics(settings)
    serde = EventSerde()
    started = time.perf_counter()
    published = 0
    async with Importer(settings, serde.encode, serde.decode, workers=default_workers(),
                        make_encoder=avro_encoder) as importer:
        async for result in importer.import_files(paths):
            published += result.published
    elapsed = time.perf_counter() - started
    if published != expected:
        raise RuntimeError(f"import published {published} of {expected} events")
    return published / elapsed


def bench_import(ctx: Context) -> list[Figure]:
    sessions, events = ctx.size(100, 10), ctx.size(1_000, 200)
    figure = Figure(f"Import: events/s of `import` ({sessions} files x {events:,} events)",
                    "events/s", [], "ingest: Avro encode + idempotent producer, same events",
                    goal=">= 30,000 events/s and >= 0.5x ingest (issue 22)")
    mix = [(f"import-{seed:03d}", event) for seed in range(sessions)
           for event in synth_session(seed, events)]
    with tempfile.TemporaryDirectory(prefix="dsh-import-bench-") as folder:
        paths = write_archive(Path(folder), sessions, events)
        for run in range(ctx.runs):
            ctx.log(f"import run {run + 1}: {len(paths)} files, {len(mix):,} events")
            figure.ours.append(asyncio.run(import_rate(ctx.settings(), paths, len(mix))))
            figure.anchor_values.append(asyncio.run(ingest_ours(ctx.settings(), mix)))
    figure.met = figure.median >= 30_000 and (figure.ratio or 0.0) >= 0.5
    figure.note = (f"{len(mix):,} events in {sessions} packed .jsonl files, 6 partitions; "
                   f"import: {default_workers()} worker processes read, check (ingest mode) "
                   "and encode the files, transactions of ~20,000 events")
    return [figure]
