"""Benchmark: the Kafka driver end to end, with the scripted provider.

Starts a local single-node Kafka (or uses ``--bootstrap``), creates fresh topics, runs one
in-process driver, puts one follow-up per session on the inbox (``--sessions``, each a
two-step tool turn: tool call, then the answer) and reads the session topic back
read_committed until every turn has ended. Reports:

* ``steps_per_s``: steps (``step/end`` records) committed per second of wall time, from the
  first inbox send to the last ``turn/end`` seen by a read-committed consumer;
* ``visible_ms_p50/p99``: for every event, the time from its ``time`` stamp (set by the
  runner when it was appended) to when a read-committed consumer received it: what the
  batching into transactions costs a live reader;
* ``transactions``, ``events``, ``events_per_transaction``;
* ``cpu_seconds`` / ``steps_per_cpu_s``: this process's CPU time from the first send to the
  last ``turn/end`` (the driver and the inbox sender; the reader and the broker run in
  processes of their own): the figure that matters on a loaded machine. The reader notes
  arrivals and decodes the records only after the run (``--decode-live``: as they arrive);
  ``--reader-in-process`` puts it on the driver's event loop, as before session 10, where
  its fetches wait behind the runners and its CPU is billed to the driver;
* ``invalid_logs``: sessions whose log does not rebuild in strict mode (must be 0);
* ``claimed_ms_p99`` (a burst only): from the inbox send to each session's first event (the
  poll, and the wait for step admission, ``--steps-per-transaction``), which ``visible_ms`` does not
  cover; ``steps_queued``: step starts that waited for admission;
* the latency split, from the driver's own commit timings (``PartitionSink.recent_commits``):
  ``waited_ms_p50/p99``, how long a transaction's oldest record waited for its transaction
  to begin (the linger, a commit in progress, a busy event loop), and
  ``committing_ms_p50/p99``, how long the transaction took (sends, offsets, EndTxn); the rest
  of ``visible_ms`` is the reader's fetch after the commit;
* ``probe_*`` (issue 33): what :mod:`pipeline.adapters.loop_probe` saw on the driver's event
  loop in the timed part: loop lag p50/p99/max, collector pauses count/total/max (ms);
  ``DSH_LOOP_PROBE=0`` runs without it (all zero).

``--ramp-s``/``--first-token-ms``/``--chunk-ms`` make the load paced instead of a burst: the
follow-ups are spread over the ramp, and the scripted model waits before its first chunk and
between chunks, as a streaming model does.

    .venv/bin/python bench/bench_driver_kafka.py --sessions 1000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import os
import pickle
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer

from dsh_dev.localstack.artifacts import Artifacts
from dsh_dev.localstack.kafka import KafkaLocal
from pipeline.adapters.cancelling import cancel_until_done
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.llm.scripted import Script, ScriptedReply, tool_loop_script
from pipeline.adapters.loop_probe import ENV as PROBE_ENV
from pipeline.adapters.loop_probe import LoopProbe, probing
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.codec.records import HEADER_TYPE
from pipeline.core.errors import DshError
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.log import SessionLog
from pipeline.services.driver.kafka_sink import STEPS_PER_TRANSACTION
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.tools import ToolRegistry, builtin_registry
from pipeline.settings import Settings


@contextlib.contextmanager
def broker(bootstrap: str | None) -> Iterator[str]:
    if bootstrap:
        yield bootstrap
        return
    with KafkaLocal(Artifacts.default().require_kafka(), heap_mb=1024) as kafka:
        yield kafka.bootstrap


async def read_until_done(settings: Settings, sessions: int, decode_live: bool = False,
                          fetch_max_wait_ms: int = 500,
                          on_started: Callable[[], None] = lambda: None,
                          ) -> tuple[list[tuple[bytes, float]], float, float]:
    """Read the session topic read_committed until ``sessions`` turns have ended.

    The reader stands in for a downstream consumer, which runs in a process of its own: by
    default it only notes each record's arrival and counts ``turn/end`` by the ``dsh.type``
    header while the driver runs, and decodes the values once the run is over, so that its
    Avro decoding is not billed to the driver (``decode_live``: decode as records arrive).
    Returns the (value, arrival ms) of every record, and the wall and CPU clocks (time.time,
    process_time) when the last turn ended.
    """
    consumer = AIOKafkaConsumer(settings.topics.session_events, **client_options(settings),
                                group_id=None, isolation_level="read_committed",
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                fetch_max_wait_ms=fetch_max_wait_ms)
    await consumer.start()
    on_started()
    arrived: list[tuple[bytes, float]] = []
    ended = 0
    try:
        while ended < sessions:
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            now_ms = time.time() * 1000
            for records in batch.values():
                for record in records:
                    arrived.append((record.value, now_ms))
                    ended += _is_turn_end(record.value, record.headers, decode_live)
        finished, cpu_finished = time.time(), time.process_time()
    finally:
        await consumer.stop()
    return arrived, finished, cpu_finished


def _reader_child(bootstrap: str, prefix: str, partitions: int, sessions: int,
                  decode_live: bool, fetch_max_wait_ms: int, started: Any, out: str) -> None:
    """The reader in a process of its own (``reader_in_process=False``): its arrivals and
    the wall clock of the last turn/end are pickled to ``out``."""
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                                 partitions=partitions, group_id_prefix=prefix)
    arrived, finished, _ = asyncio.run(read_until_done(settings, sessions, decode_live,
                                                       fetch_max_wait_ms, started.set))
    Path(out).write_bytes(pickle.dumps((arrived, finished)))


@contextlib.asynccontextmanager
async def reader_process(settings: Settings, sessions: int, decode_live: bool,
                         fetch_max_wait_ms: int) -> AsyncIterator[Callable[[], Awaitable[
                             tuple[list[tuple[bytes, float]], float]]]]:
    """Starts the reader's process and waits until its consumer has started; yields the
    coroutine function that waits for its result."""
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    with tempfile.NamedTemporaryFile(suffix=".pickle") as out:
        child = context.Process(target=_reader_child, args=(
            settings.bootstrap_servers, settings.topic_prefix, settings.partitions, sessions,
            decode_live, fetch_max_wait_ms, started, out.name))
        child.start()
        try:
            if not await asyncio.to_thread(started.wait, 120):
                raise RuntimeError("the reader process did not start its consumer")

            async def result() -> tuple[list[tuple[bytes, float]], float]:
                await asyncio.to_thread(child.join, 600)
                if child.exitcode != 0:
                    raise RuntimeError(f"the reader process exited with {child.exitcode}")
                arrived, finished = pickle.loads(Path(out.name).read_bytes())
                return arrived, finished
            yield result
        finally:
            if child.is_alive():
                child.kill()
            child.join(10)


@contextlib.asynccontextmanager
async def reader_on_this_loop(settings: Settings, sessions: int, decode_live: bool,
                              fetch_max_wait_ms: int) -> AsyncIterator[Callable[[], Awaitable[
                                  tuple[list[tuple[bytes, float]], float]]]]:
    """The reader as a task on this event loop (``reader_in_process``); yields what
    :func:`reader_process` yields."""
    task = asyncio.create_task(read_until_done(settings, sessions, decode_live,
                                               fetch_max_wait_ms))

    async def result() -> tuple[list[tuple[bytes, float]], float]:
        arrived, finished, _ = await task
        return arrived, finished
    try:
        yield result
    finally:
        await cancel_until_done([task])


_TURN_END_HEADER = (HEADER_TYPE, b"turn/end")


def _is_turn_end(value: bytes, headers: Sequence[tuple[str, bytes]], decode: bool) -> bool:
    if decode:
        return EVENT_SERDE.decode(value)[1].type == "turn/end"
    return _TURN_END_HEADER in headers


EVENT_SERDE = EventSerde()


def decode_arrivals(arrived: list[tuple[bytes, float]]
                    ) -> tuple[dict[str, list[Event]], list[float]]:
    """Each session's events, and for every event the ms from its ``time`` to its arrival."""
    logs: dict[str, list[Event]] = {}
    visible_ms: list[float] = []
    for value, arrived_ms in arrived:
        session_id, event = EVENT_SERDE.decode(value)
        logs.setdefault(session_id, []).append(event)
        visible_ms.append(arrived_ms - event.time)
    return logs, visible_ms


@dataclasses.dataclass(frozen=True, slots=True)
class Pacing:
    """A paced load: follow-ups spread over ``ramp_s``; the model's first-chunk delay and
    the delay between chunks. All zero: a burst."""

    ramp_s: float = 0.0
    first_token_ms: int = 0
    chunk_ms: int = 0


def paced_script(pacing: Pacing) -> Script:
    base = tool_loop_script("echo", '{"text": "pong"}')

    def script(request: object, attempt: int) -> ScriptedReply:
        reply = base(request, attempt)  # type: ignore[arg-type]
        return dataclasses.replace(reply, delay_ms=pacing.first_token_ms,
                                   chunk_delay_ms=pacing.chunk_ms)

    return script if pacing.first_token_ms or pacing.chunk_ms else base


async def send_paced(settings: Settings, records: list[OutRecord], ramp_s: float) -> None:
    """Send ``records`` at once, or in slices every 50 ms over ``ramp_s`` (one producer)."""
    if ramp_s <= 0:
        await send_records(settings, records)
        return
    from aiokafka import AIOKafkaProducer
    producer = AIOKafkaProducer(**client_options(settings), enable_idempotence=True,
                                acks="all", linger_ms=0)
    await producer.start()
    try:
        slices = max(1, int(ramp_s / 0.05))
        per = -(-len(records) // slices)
        started = time.perf_counter()
        for index in range(slices):
            await asyncio.sleep(max(0.0, started + index * 0.05 - time.perf_counter()))
            for record in records[index * per:(index + 1) * per]:
                await producer.send(record.topic, record.value, key=record.key)
        await producer.flush()
    finally:
        await producer.stop()


def commit_split(service: DriverService) -> dict[str, float]:
    """p50/p99 of the driver's own commit timings (ms) over every owned partition."""
    timings = [t for owned in service.owned.values() for t in owned.sink.recent_commits]
    if len(timings) < 2:
        return {}
    waited = statistics.quantiles([t.waited * 1000 for t in timings], n=100)
    committing = statistics.quantiles([t.committing * 1000 for t in timings], n=100)
    return {"waited_ms_p50": round(waited[49], 1), "waited_ms_p99": round(waited[98], 1),
            "committing_ms_p50": round(committing[49], 1),
            "committing_ms_p99": round(committing[98], 1)}


async def run(bootstrap: str, sessions: int, partitions: int, linger_ms: float,
              pipelined: bool = False, decode_live: bool = False,
              pacing: Pacing = Pacing(), reader_wait_ms: int = 500,
              steps_per_transaction: int = STEPS_PER_TRANSACTION,
              refill_below: int | None = None,
              reader_in_process: bool = False, tools: ToolRegistry | None = None,
              script: Script | None = None) -> dict[str, float]:
    """One measured run (see the module docs). The reader runs in a process of its own, as
    a downstream consumer does; ``reader_in_process``: on the driver's event loop, as this
    benchmark did before session 10 (its fetches then wait behind the runners, and its CPU
    is billed to the driver). ``tools`` and ``script``: other than the built-ins and the
    echo tool loop (bench/bench_mcp.py's MCP fleet)."""
    prefix = f"bench{uuid.uuid4().hex[:8]}."
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                                 partitions=partitions, group_id_prefix=prefix)
    await ensure_topics(settings)
    ctx = driver_context(settings, group_id=f"{prefix}driver",
                         tools=tools or builtin_registry(), linger_ms=linger_ms,
                         script=script or paced_script(pacing),
                         pipelined_flush=pipelined,
                         steps_per_transaction=steps_per_transaction)
    service = DriverService(ctx, DriverConfig(linger_ms=linger_ms,
                                              max_turns_in_flight=max(sessions, 2),
                                              resume_below=max(sessions, 2) - 1))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.wait_for(service.ready.wait(), 60)
    for owned in service.owned.values():  # A/B of the budget's refill rule
        if refill_below is not None:
            owned.sink.refill_below = refill_below
    codec = InboxCodec()
    records = [OutRecord(settings.topics.inbox, f"s{n}".encode(), codec.encode(
        FollowUp(f"s{n}", f"m{n}", ({"type": "text", "text": f"ping {n}"},))))
        for n in range(sessions)]
    async with contextlib.AsyncExitStack() as stack:
        open_reader = reader_on_this_loop if reader_in_process else reader_process
        reader = await stack.enter_async_context(open_reader(
            settings, sessions, decode_live, reader_wait_ms))
        probe = (await stack.enter_async_context(probing())
                 if os.environ.get(PROBE_ENV, "1") != "0" else LoopProbe())  # A/B: off
        started, cpu_started = time.time(), time.process_time()
        sent_ms = started * 1000
        await send_paced(settings, records, pacing.ramp_s)
        arrived, finished = await reader()
        cpu_finished = time.process_time()
        seen = probe.window()
    metrics = service.metrics_snapshot()
    split = {**commit_split(service), **{f"probe_{k}": v for k, v in seen.items()}}
    metrics["cpu_ms"] = int((cpu_finished - cpu_started) * 1000)
    queued = [o.sink.step_budget.queued for o in service.owned.values()
              if o.sink.step_budget is not None]
    if queued:
        split["steps_queued"] = sum(queued)
    stop.set()
    await task
    logs, visible_ms = decode_arrivals(arrived)
    if not pacing.ramp_s:  # every follow-up was sent at sent_ms
        split["claimed_ms_p99"] = round(statistics.quantiles(
            [events[0].time - sent_ms for events in logs.values()], n=100)[98], 1)
    return {**summarize(logs, visible_ms, finished - started, metrics), **split}


def summarize(logs: dict[str, list[Event]], visible_ms: list[float], elapsed: float,
              metrics: dict[str, int]) -> dict[str, float]:
    invalid = 0
    for session_id, session_events in logs.items():
        try:
            SessionLog.from_events(session_id, session_events)
        except DshError:
            invalid += 1
    steps = sum(1 for session_events in logs.values() for e in session_events
                if e.type == "step/end")
    events = sum(len(v) for v in logs.values())
    cuts = statistics.quantiles(visible_ms, n=100)
    return {"sessions": len(logs), "steps": steps, "events": events,
            "elapsed_s": round(elapsed, 3), "steps_per_s": round(steps / elapsed, 1),
            "events_per_s": round(events / elapsed, 1),
            "visible_ms_p50": round(cuts[49], 1), "visible_ms_p99": round(cuts[98], 1),
            "cpu_seconds": metrics["cpu_ms"] / 1000,
            "steps_per_cpu_s": round(steps / max(metrics["cpu_ms"] / 1000, 1e-3), 1),
            "transactions": metrics["transactions"],
            "events_per_transaction": round(events / max(metrics["transactions"], 1), 1),
            "invalid_logs": invalid}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--linger-ms", type=float, default=25.0)
    parser.add_argument("--bootstrap", help="use this broker instead of starting one")
    parser.add_argument("--pipelined-flush", action="store_true",
                        help="step boundaries do not wait for their commit")
    parser.add_argument("--decode-live", action="store_true",
                        help="the reader decodes records as they arrive (in the timed part)")
    parser.add_argument("--ramp-s", type=float, default=0.0,
                        help="spread the follow-ups over this many seconds (0: a burst)")
    parser.add_argument("--first-token-ms", type=int, default=0,
                        help="the scripted model's delay before its first chunk")
    parser.add_argument("--chunk-ms", type=int, default=0,
                        help="the scripted model's delay between chunks")
    parser.add_argument("--steps-per-transaction", type=int, default=STEPS_PER_TRANSACTION,
                        help="at most about this many sessions of a partition begin a step "
                             "while its transaction commits (0: no bound)")
    parser.add_argument("--reader-in-process", action="store_true",
                        help="read on the driver's event loop instead of a process of its own")
    parser.add_argument("--warmup", type=int, default=20,
                        help="sessions of a first, unmeasured run")
    args = parser.parse_args()
    with broker(args.bootstrap) as bootstrap:
        if args.warmup:  # a fresh broker creates its offsets/transaction topics on first use
            asyncio.run(run(bootstrap, args.warmup, args.partitions, args.linger_ms))
        pacing = Pacing(args.ramp_s, args.first_token_ms, args.chunk_ms)
        result = asyncio.run(run(bootstrap, args.sessions, args.partitions, args.linger_ms,
                                 args.pipelined_flush, args.decode_live, pacing,
                                 steps_per_transaction=args.steps_per_transaction,
                                 reader_in_process=args.reader_in_process))
    print(json.dumps({**result, "partitions": args.partitions,
                      "pipelined_flush": args.pipelined_flush,
                      "decode_live": args.decode_live,
                      "steps_per_transaction": args.steps_per_transaction}))


if __name__ == "__main__":
    main()
