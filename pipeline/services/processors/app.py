"""The processors faust app, built by :func:`build_processors` from settings (nothing at import).

Topology (all tables have changelog topics ``<app id>-<table>-changelog``, co-partitioned
with their source topic, and ``options.standby_replicas`` standby copies):

    session-events ══fold_sessions══> tables sessions (all per-session state), nodes, chunk-marks
         │                            ├─> derived-messages (compacted, slot-keyed changes)
         │                            ├─> usage  (session totals)      ├─> fleet (compacted)
         │                            └─> <app id>-usage-by-model (internal, keyed by model)
         └─> session-events.dlq (undecodable, gaps, invalid)              │
    ticks (timer: wall clock) ═════════════════════════════> fold_usage ═┴─> table usage-agg
                                                                           └─> usage (model
                                                                               totals, windows)

``══``: the session topic and the usage-by-model topic reach their agents one fetched batch
per partition at a time (one faust event per batch, :mod:`pipeline.adapters.faust.transport`),
so faust's per-record cost is paid per batch. Each batch is planned by the pure batch step
and its plan performed by the one executor (:mod:`pipeline.adapters.faust.executor`); the
session tables are written once per commit, right before it
(:mod:`pipeline.adapters.faust.pending`); the outputs are sent as each batch is folded.

Delivery is at-least-once; every fold is idempotent by (session, seq), so redelivery after a
crash or rebalance changes nothing (faust's ``exactly_once`` is not used: see the notes on its
duplicates after crashes).
"""

from __future__ import annotations

import gc
import json
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import faust

from pipeline.adapters.faust.changelog_queue import ChangelogTableManager
from pipeline.adapters.faust.executor import BatchExecutor, Handle
from pipeline.adapters.faust.failures import WorkerStop
from pipeline.adapters.faust.flushing import DirectTopic
from pipeline.adapters.faust.private_api import rebuild_changelog_topic
from pipeline.adapters.faust.tables import ChangelogTable, Older
from pipeline.adapters.faust.transport import use_batching_transport
from pipeline.adapters.kafka.admin import retrying_transient
from pipeline.adapters.kafka.dlq_reader import dead_lettered_offsets
from pipeline.adapters.kafka.dlq_writer import DeadLetterWriter
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.projection_follow import ProjectionFollow
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.session_span import session_records_before
from pipeline.adapters.kafka.topic_scan import ensure_topic
from pipeline.adapters.loop_probe import LoopProbe
from pipeline.codec.outputs import OutputCodecs
from pipeline.core.errors import ConfigError
from pipeline.core.prices import PriceTable
from pipeline.core.usage import WINDOW_SIZES_MS
from pipeline.services.processors.aggregation import UsageAggregator, tick_value
from pipeline.services.processors.folding import Decoder, Send, SessionFolder
from pipeline.services.processors.options import ProcessorsOptions
from pipeline.services.processors.session_state import (
    SessionTables,
    chunk_mark_older,
    session_record_older,
)
from pipeline.services.processors.web import register_views
from pipeline.services.processors.worker import Processors
from pipeline.settings import Settings

log = logging.getLogger(__name__)

SESSION_TABLES = ("sessions", "nodes", "chunk-marks")
USAGE_TABLE = "usage-agg"
# How each session table tells a stale changelog record (a late write of a worker that lost
# the partition) from the value it holds: see pipeline.adapters.faust.tables.
TABLE_RECORD_OLDER: dict[str, Older] = {"sessions": session_record_older,
                                        "chunk-marks": chunk_mark_older}


def faust_broker_options(settings: Settings) -> dict[str, Any]:
    """faust's ``broker`` URLs and credentials from the same settings aiokafka uses."""
    options = client_options(settings)  # validates protocol, SASL, TLS; raises ConfigError
    hosts = [h.strip() for h in settings.bootstrap_servers.split(",") if h.strip()]
    result: dict[str, Any] = {"broker": [f"kafka://{h}" for h in hosts]}
    protocol = options["security_protocol"]
    if protocol.startswith("SASL_"):
        result["broker_credentials"] = faust.SASLCredentials(
            username=options["sasl_plain_username"], password=options["sasl_plain_password"],
            mechanism=options["sasl_mechanism"], ssl_context=options.get("ssl_context"))
    elif protocol == "SSL":
        result["broker_credentials"] = faust.SSLCredentials(options["ssl_context"])
    return result


async def ensure_internal_topics(settings: Settings, options: ProcessorsOptions, *,
                                 retry_for_s: float = 0.0) -> None:
    """Create the usage-by-model topic and the tables' changelogs before the worker starts,
    and wait until the metadata shows them.

    faust declares them itself when the agents start, but on a multi-broker cluster the
    group leader's metadata may not show them yet when it assigns partitions: the usage
    topic then gets no partitions until a later rebalance (``/usage/models`` stays empty),
    and a table whose changelog shows 0 partitions crashes its agent (faust's
    ``PartitionsMismatch``, seen on the 3-node cluster). The usage topic is kept like the
    session topic (no retention), changelogs are compacted as faust makes them; an existing
    topic is left as it is. ``retry_for_s``: as :func:`ensure_topics` (a node restarting).
    """
    topics = [(options.usage_topic(settings), False),
              *((f"{options.app_id(settings)}-{table}-changelog", True)
                for table in (*SESSION_TABLES, USAGE_TABLE))]
    for topic, compact in topics:
        await retrying_transient(partial(ensure_topic, settings, topic, compact=compact),
                                 retry_for_s)


def _new_app(settings: Settings, options: ProcessorsOptions) -> Any:
    app = faust.App(
        options.app_id(settings),
        **faust_broker_options(settings),
        store=options.store,
        autodiscover=False,
        datadir=options.data_dir,
        web_enabled=True,
        web_host=options.web_host,
        web_bind=options.web_host,
        web_port=options.web_port,
        canonical_url=f"http://{options.web_host}:{options.web_port}",
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        table_standby_replicas=options.standby_replicas,
        consumer_auto_offset_reset="earliest",
        key_serializer="raw",
        value_serializer="raw",
        stream_wait_empty=False,
        producer_acks=-1,
        # The one record limit (DSH_MAX_RECORD_BYTES): table records and their fetches.
        producer_max_request_size=settings.max_record_bytes,
        consumer_max_fetch_size=settings.max_record_bytes,
        Topic=DirectTopic,   # table writes skip a per-write event-loop detour
        Table=ChangelogTable,   # changelogs with two writers at once (its module doc)
        # standby reads keep what they fetched when the recovery ends (its module doc)
        TableManager=ChangelogTableManager,
        # A killed worker's partitions move once its session expires: keep that short.
        broker_session_timeout=options.session_timeout_s,
        broker_heartbeat_interval=min(3.0, options.session_timeout_s / 3),
        web_tables_enabled=False,
        web_graph_enabled=False,
        # Counted in batch messages for the session topic: a few fetches ahead is plenty.
        stream_buffer_maxsize=options.stream_buffer,
    )
    use_batching_transport(app, [settings.topics.session_events, options.usage_topic(settings)],
                           fetch_max_wait_ms=options.fetch_max_wait_ms,
                           fetch_min_bytes=options.fetch_min_bytes)
    return app


def _table(app: Any, name: str, partitions: int, older: Older | None = None) -> Any:
    table = app.Table(name, default=None, partitions=partitions, key_type=str, older=older)
    # Raw UTF-8 keys (faust would JSON-quote them): the changelog key is then the session id
    # itself, so faust's router hashes it like the session topic's partitioner does and
    # forwards an HTTP request to the worker that really owns the session.
    table.key_serializer = "raw"
    table.changelog_topic = rebuild_changelog_topic(table)  # built in __init__: JSON keys
    return table


def build_processors(settings: Settings, decode: Decoder,
                     options: ProcessorsOptions | None = None,
                     window_sizes_ms: Mapping[str, int] | None = None,
                     outputs: OutputCodecs | None = None,
                     prices: PriceTable | None = None) -> Processors:
    """The whole app, ready for a faust worker to run. No I/O happens here. ``outputs``
    encode the output topics' values (default: Avro single-object encoding); ``prices``
    price the cost ledger (default: none, every call unpriced)."""
    options = options or ProcessorsOptions()
    sizes = dict(window_sizes_ms or WINDOW_SIZES_MS)
    if not sizes or any(v <= 0 for v in sizes.values()):
        raise ConfigError(f"usage window sizes must be positive, got {sizes}")
    app = _new_app(settings, options)
    parts = settings.partitions
    tables = SessionTables(*(_table(app, name, parts, TABLE_RECORD_OLDER.get(name))
                             for name in SESSION_TABLES))
    processors = Processors(app, settings, options, tables, _table(app, USAGE_TABLE, parts),
                            decode)
    if options.loop_probe:
        _wire_loop_probe(processors)

    async def send(out: OutRecord) -> object:
        return await app.producer.send(out.topic, out.key, out.value, out.partition, None,
                                       list(out.headers) or None)   # the delivery

    follow = _wire_projection_follow(processors)
    stop = WorkerStop(processors.app)
    _wire_sessions(processors, decode, send, follow, outputs, stop)
    _wire_usage(processors, send, sizes, outputs, stop, prices)
    register_views(processors)   # after the tables exist
    return processors


def worker_id(options: ProcessorsOptions) -> str:
    """This worker's name among the projection's writers (host and HTTP port: unique)."""
    return f"{options.app_name}@{socket.gethostname()}:{options.web_port}".replace("/", "_")


def _wire_projection_follow(processors: Processors) -> ProjectionFollow:
    """The worker's follower of the derived-messages versions, started and stopped with it
    (see :mod:`pipeline.adapters.kafka.projection_follow`)."""
    topic = processors.settings.topics.session_events
    follow = ProjectionFollow(processors.settings, worker_id(processors.options),
                              owned=lambda: processors.active_partitions(topic))
    processors.follow = follow

    class FollowingProjection(faust.Service):
        async def on_start(self) -> None:
            await follow.start()   # raises (the worker does not start) if unreadable

        async def on_stop(self) -> None:
            try:
                await follow.stop()
            except Exception as exc:  # the writer record stays; replay names it
                log.warning("withdrawing projection writer %s failed: %s", follow.worker, exc)

    processors.app.service(FollowingProjection)
    return follow


def _wire_loop_probe(processors: Processors) -> None:
    """The benchmarks' loop-lag and collector probe (``DSH_LOOP_PROBE=1``), started and
    stopped with the worker; it also counts the session topic's batch sizes."""
    probe = processors.loop_probe = LoopProbe()

    class LoopLagProbe(faust.Service):
        async def on_start(self) -> None:
            probe.start()

        async def on_stop(self) -> None:
            await probe.stop()

    processors.app.service(LoopLagProbe)


def _wire_sessions(processors: Processors, decode: Decoder, send: Send,
                   route: ProjectionFollow, outputs: OutputCodecs | None,
                   stop: WorkerStop) -> None:
    app, settings = processors.app, processors.settings
    source = app.topic(settings.topics.session_events, key_type=bytes, value_type=bytes)
    folder = SessionFolder(processors.tables, send, decode, settings.topics,
                           processors.options.usage_topic(settings), processors.counters,
                           route, outputs=outputs,
                           max_record_bytes=app.conf.producer_max_request_size,
                           dead_lettered=partial(dead_lettered_offsets, settings,
                                                 settings.topics.session_events),
                           read_back=partial(_read_back, settings,
                                             processors.options.heal_span_max),
                           dead_letter_sink=_dead_letter_writer(processors))
    processors.folder = folder
    handle: Handle = folder.executor.fold   # the batch walk: pipeline.adapters.faust.executor
    if processors.loop_probe is not None:
        handle = processors.loop_probe.counting(handle)
    executor = BatchExecutor(app, source.get_topic_name(), handle, stop=stop,
                             counters=processors.counters,
                             principal=processors.principal,
                             pending=folder.executor, on_assignment=partial(_reread_pointer, route),
                             producer_buffer=processors.options.producer_buffer)
    executor.install()
    app.agent(source, name="fold-sessions")(executor.run)


def _dead_letter_writer(processors: Processors) -> DeadLetterWriter:
    """The worker's writer of dead letters (one transactional producer per claimed
    partition), stopped with the worker."""
    writer = DeadLetterWriter(processors.settings,
                              processors.options.app_id(processors.settings))

    class DlqProducers(faust.Service):   # faust logs the name: no "dead" in a sound log
        async def on_stop(self) -> None:
            await writer.release()

    processors.app.service(DlqProducers)
    return writer


async def _read_back(settings: Settings, span_max: int, partition: int, session_id: str,
                     from_seq: int, before_offset: int) -> Sequence[Any]:
    """The heal's read of a session's records from the session topic (:mod:`.folding`)."""
    return await session_records_before(settings, settings.topics.session_events, partition,
                                        session_id, from_seq, before_offset,
                                        max_span=span_max)


async def _reread_pointer(follow: ProjectionFollow) -> None:
    try:  # a handover may be pending for partitions this worker now owns
        await follow.refresh()
    except Exception as exc:  # the follower retries at its next poll
        log.warning("reading the projection pointer on assignment failed: %s", exc)


def _wire_usage(processors: Processors, send: Send, sizes: Mapping[str, int],
                outputs: OutputCodecs | None, stop: WorkerStop,
                prices: PriceTable | None) -> None:
    app, settings, options = processors.app, processors.settings, processors.options
    name = options.usage_topic(settings)
    by_model = app.topic(name, key_type=bytes, value_type=bytes, internal=True,
                         partitions=settings.partitions)
    aggregator = UsageAggregator(processors.usage_agg, send, settings.topics.usage,
                                 processors.counters, lambda: processors.active_partitions(name),
                                 grace_ms=options.grace_ms, sizes=sizes,
                                 epoch=processors.tables_epoch,
                                 outputs=outputs, prices=prices)
    processors.aggregator = aggregator

    async def fold(records: Sequence[Any], _batch: Any) -> None:
        # its table writes are made as it folds: nothing pending, folded once this returns
        await aggregator.handle_batch(records[0].partition,
                                      [json.loads(r.value) for r in records])

    executor = BatchExecutor(app, name, fold, stop=stop, counters=processors.counters,
                             principal=processors.principal)
    executor.install()

    async def tick() -> None:
        # Windows close on wall-clock time even when no event arrives: the tick goes through
        # the stream so the close is folded (and its table writes land) like any record.
        if options.freeze_gc:
            freeze_survivors()
        now_ms = int(time.time() * 1000)
        processors.observe_steps(now_ms)
        for partition in aggregator.partitions_to_tick(processors.active_partitions(name),
                                                       now_ms):
            await send(OutRecord(name, b"tick", tick_value(now_ms), (), partition))

    app.agent(by_model, name="fold-usage")(executor.run)
    app.timer(options.tick_interval_s)(tick)


def freeze_survivors() -> None:
    """Move every object alive now out of the cyclic garbage collector's reach.

    The memory store keeps all table values as Python objects, and the collector's full
    passes walk all of them: with a backlog folded that is 60-470 ms per pass (measured),
    a stall of the whole worker that lands straight in the latency tail, to free almost
    nothing (table values hold no reference cycles; a whole run freed ~1,400 objects).
    Frozen objects are still freed by reference counting; only a reference cycle that is
    alive at a freeze and dies later is never collected, which the counts above make a
    small, bounded leak. Called once a tick, so full passes only see the last tick's objects.
    """
    gc.freeze()
