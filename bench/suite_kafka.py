"""Broker benchmarks: ingest, consume and decode, replay (with Kafka's tools as anchors).

The events are :mod:`dsh_dev.synth` sessions (the fixtures' mix: ~87% chunks, record
sizes as the codec makes them); every run writes to fresh topics, so nothing is read from a
warm topic that another run or benchmark wrote, except where said (consume reads what its own
run's ingest wrote, as a consumer of a live topic would: from the broker's page cache).
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from suite_core import Context, Figure
from suite_tools import ToolError, consumer_performance, producer_performance

from dsh_dev.synth import synth_session
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.topic_scan import BulkProducer, TopicScan, ensure_topic
from pipeline.codec.avro import EventSerde
from pipeline.codec.records import event_headers, record_key
from pipeline.core.events import Event, dumps_json
from pipeline.services.replay.rebuild import Rebuilder
from pipeline.settings import Settings

Mix = list[tuple[str, Event]]


@functools.lru_cache(maxsize=2)
def synth_mix(total: int, sessions: int = 50) -> tuple[tuple[str, Event], ...]:
    """``total`` events of ``sessions`` synthetic sessions, session after session."""
    per = max(1, total // sessions)
    return tuple((f"bench-{seed}", event) for seed in range(sessions)
                 for event in synth_session(seed, per))


def mean_avro_size(mix: Mix) -> int:
    serde = EventSerde()
    return round(statistics.fmean(len(serde.encode(s, e)) for s, e in mix[:20_000]))


async def fresh_topic(settings: Settings, topic: str) -> None:
    """Create ``topic`` and wait until every partition has a leader (list-offsets answers),
    so no run times the leader elections of a topic created a moment before."""
    await ensure_topic(settings, topic, compact=False)
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(settings.partitions)]
        await consumer.end_offsets(parts)
    finally:
        await consumer.stop()


async def ingest_ours(settings: Settings, mix: Mix) -> float:
    """events/s: Avro encode + headers + BulkProducer (idempotent, acks=all)."""
    await fresh_topic(settings, settings.topics.session_events)
    serde, topic = EventSerde(), settings.topics.session_events
    async with BulkProducer(settings) as out:
        started = time.perf_counter()
        await out.send_many(topic, ((record_key(session_id), serde.encode(session_id, event),
                                     event_headers(event)) for session_id, event in mix))
        await out.flush()
        return len(mix) / (time.perf_counter() - started)


async def ingest_json(settings: Settings, mix: Mix) -> float:
    """events/s: the same events as JSON through a plain aiokafka producer (same config)."""
    topic = f"{settings.topic_prefix}json-anchor"
    await fresh_topic(settings, topic)
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, acks="all",
                                enable_idempotence=True, linger_ms=20,
                                max_batch_size=512 * 1024)
    await producer.start()
    try:
        started = time.perf_counter()
        futures = []
        for session_id, event in mix:
            futures.append(await producer.send(
                topic, dumps_json(event.to_json()).encode(), key=session_id.encode()))
            if len(futures) >= 10_000:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
        return len(mix) / (time.perf_counter() - started)
    finally:
        await producer.stop()


async def consume_ours(settings: Settings, expected: int) -> float:
    """events/s: TopicScan (read_committed) + EventSerde.decode of every record, read as
    the client returns them (``client_batches``, as replay's readers do)."""
    decode = EventSerde().decode
    async with TopicScan(settings, settings.topics.session_events) as scan:
        started, seen = time.perf_counter(), 0
        async for run in scan.client_batches():
            for record in run:
                decode(record.value or b"")
            seen += len(run)
    if seen != expected:
        raise RuntimeError(f"consume read {seen} of {expected} records")
    return seen / (time.perf_counter() - started)


def bench_ingest_consume(ctx: Context) -> list[Figure]:
    mix = list(synth_mix(ctx.size(100_000, 3_000)))
    size = mean_avro_size(mix)
    ingest = Figure("Ingest: events/s into the session topic (Avro, acks=all)", "events/s",
                    [], "ProducerPerformance, same count/size/partitions, acks=all",
                    goal="ratio >= 0.35 (issue 21)")
    json_anchor = Figure("Ingest vs plain aiokafka + JSON producer (same events, same config)",
                         "events/s", [], "aiokafka + JSON", goal="ratio >= 1.5 (issue 21)")
    consume = Figure("Consume and decode: events/s (TopicScan + EventSerde.decode)",
                     "events/s", [], "ConsumerPerformance fetch.nMsg.sec, same topic",
                     goal="ratio >= 0.5 (issue 21)")
    for run in range(ctx.runs):
        settings = ctx.settings()
        ctx.log(f"ingest run {run + 1}: {len(mix)} events, mean Avro record {size} bytes")
        rate = asyncio.run(ingest_ours(settings, mix))
        ingest.ours.append(rate)
        json_anchor.ours.append(rate)
        json_anchor.anchor_values.append(asyncio.run(ingest_json(settings, mix)))
        consume.ours.append(asyncio.run(consume_ours(settings, len(mix))))
        if ctx.tools_lib is not None:
            _java_anchors(ctx, settings, len(mix), size, ingest, consume)
    note = (f"{len(mix):,} events, mean Avro record {size} bytes, 6 partitions; producers: "
            "batch 512 KiB, linger 20 ms, idempotent, no compression")
    ingest.note = json_anchor.note = consume.note = note
    for figure, least in ((ingest, 0.35), (json_anchor, 1.5), (consume, 0.5)):
        if figure.ratio is not None:
            figure.met = figure.ratio >= least
    return [ingest, json_anchor, consume]


def _java_anchors(ctx: Context, settings: Settings, count: int, size: int, ingest: Figure,
                  consume: Figure) -> None:
    assert ctx.tools_lib is not None
    topic = f"{settings.topic_prefix}pp-anchor"
    asyncio.run(fresh_topic(settings, topic))
    try:
        ingest.anchor_values.append(producer_performance(
            ctx.tools_lib, ctx.bootstrap, topic, count, size))
        consume.anchor_values.append(consumer_performance(
            ctx.tools_lib, ctx.bootstrap, settings.topics.session_events, count))
    except ToolError as exc:
        ctx.log(f"anchor failed: {exc}")


async def fill_topic(settings: Settings, total: int) -> int:
    """Write ``total`` events: the synthetic mix repeated under distinct session ids."""
    await ensure_topics(settings)
    await fresh_topic(settings, settings.topics.session_events)
    template = synth_mix(min(total, 100_000))
    serde, topic, written, copy = EventSerde(), settings.topics.session_events, 0, 0
    async with BulkProducer(settings) as out:
        while written < total:
            for session_id, event in template[: total - written]:
                sid = f"{session_id}-{copy}"
                await out.send(topic, record_key(sid), serde.encode(sid, event),
                               event_headers(event))
            written += min(len(template), total - written)
            copy += 1
    return written


def bench_replay(ctx: Context) -> list[Figure]:
    total = ctx.size(1_000_000, 5_000)
    runs = 1 if total >= 1_000_000 else ctx.runs
    figure = Figure(f"Replay: events/s rebuilding derived messages from a {total:,}-event topic",
                    "events/s", [], "ConsumerPerformance on the same topic (read only)")
    settings = ctx.settings()
    ctx.log(f"replay: writing {total} events (not timed)")
    asyncio.run(fill_topic(settings, total))
    per_cpu = Figure("Replay: events per CPU-second of the replay process", "events/CPU-s",
                     [], goal=">= 100,000 events/s (issue 6)",
                     note="process time of the benchmark process, which runs the Rebuilder "
                          "(its consumer, fold and producer) and nothing else meanwhile")
    serde = EventSerde()
    for run in range(runs):
        cpu_before = time.process_time()
        result = asyncio.run(Rebuilder(settings, serde.decode, run + 1).run())
        per_cpu.ours.append(result.events / max(time.process_time() - cpu_before, 1e-9))
        figure.ours.append(result.events / result.seconds)
        ctx.log(f"replay run {run + 1}: {result.events} events in {result.seconds:.1f} s")
        if ctx.tools_lib is not None:
            try:
                figure.anchor_values.append(consumer_performance(
                    ctx.tools_lib, ctx.bootstrap, settings.topics.session_events, total))
            except ToolError as exc:
                ctx.log(f"anchor failed: {exc}")
    figure.note = (f"{runs} run(s); the Rebuilder reads every record, decodes and folds the "
                   "surface events (the others are judged by their headers), and writes the "
                   "last change per slot key to a compacted version topic")
    return [figure, per_cpu]
