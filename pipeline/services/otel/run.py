"""The otel service put together: the event batches of its consumer group, the OTLP/HTTP
exporter, the dead-letter producer and the ``/health`` + ``/metrics`` server."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.adapters.cancelling import cancel_until_done
from pipeline.adapters.kafka.event_batches import EventBatches
from pipeline.adapters.kafka.event_stream import Decoder, Start
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.metrics.consumer_groups import ConsumerGroupProbe
from pipeline.adapters.metrics.http import StatusHttpServer
from pipeline.adapters.otlp.client import OtlpHttpExporter, parse_headers
from pipeline.adapters.otlp.encode import export_request
from pipeline.core.errors import DshError
from pipeline.core.genai_trace import SEMCONV_OPT_IN, SEMCONV_VERSION, SPAN_EVENT_TYPES, Span
from pipeline.services.otel.metrics import OtelMetrics
from pipeline.services.otel.service import OtelOptions, OtelService
from pipeline.settings import Settings

log = logging.getLogger(__name__)
OPT_IN_VARIABLE = "OTEL_SEMCONV_STABILITY_OPT_IN"


@dataclass(frozen=True, slots=True)
class OtelRun:
    group_id: str
    start: Start = Start.COMMITTED
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None  # None: settings.otel_metrics_port; -1: no server
    backoff_s: float = 0.5  # the exporter's first retry delay (doubles up to 30 s)
    group_probe_s: float = 15.0  # how often the project's consumer groups are described


def group_of(settings: Settings) -> str:
    return f"{settings.group_id_prefix}otel"


def semconv_opt_in() -> None:
    """Name the conventions followed to any OpenTelemetry library in this process."""
    current = os.environ.get(OPT_IN_VARIABLE, "")
    if SEMCONV_OPT_IN not in current.split(","):
        os.environ[OPT_IN_VARIABLE] = ",".join(filter(None, (current, SEMCONV_OPT_IN)))


async def serve_otel(settings: Settings, decode: Decoder, stop: asyncio.Event, *,
                     run: OtelRun, options: OtelOptions | None = None,
                     metrics: OtelMetrics | None = None,
                     on_started: asyncio.Future[int] | None = None) -> OtelService:
    """Export until ``stop`` is set; ``on_started`` gets the metrics port (0 when none)."""
    semconv_opt_in()
    metrics = metrics or OtelMetrics()
    exporter = OtlpHttpExporter(settings.otlp_endpoint,
                                parse_headers(settings.otlp_headers.reveal()),
                                backoff_s=run.backoff_s,
                                on_retry=lambda _why: metrics.retries.inc())
    source = EventBatches(settings, decode=decode, types=SPAN_EVENT_TYPES,
                          group_id=run.group_id, start=run.start)

    def encode(spans: Sequence[Span]) -> bytes:
        return export_request(spans)

    async def send(records: Sequence[OutRecord]) -> None:
        await send_records(settings, records)

    service = OtelService(source, exporter, encode=encode, send_dead_letters=send,
                          dlq_topic=settings.topics.dlq(settings.topics.session_events),
                          metrics=metrics, options=options)
    server = StatusHttpServer(service.health, metrics.registry)
    port = settings.otel_metrics_port if run.metrics_port is None else run.metrics_port
    probe = ConsumerGroupProbe(settings, settings.group_id_prefix)
    groups: asyncio.Task[None] | None = None
    try:
        await source.start()
        bound = await server.start(run.metrics_host, port) if port >= 0 else 0
        log.info("otel: GenAI semantic conventions v%s (%s=%s) to %s", SEMCONV_VERSION,
                 OPT_IN_VARIABLE, SEMCONV_OPT_IN, exporter.display_url)
        groups = asyncio.create_task(_sample_groups(probe, metrics, run.group_probe_s))
        if on_started is not None and not on_started.done():
            on_started.set_result(bound)
        await _run_until(service, stop)
    finally:
        if groups is not None:
            await cancel_until_done([groups])
        await probe.stop()
        await server.close()
        await source.stop()
        await exporter.close()
    return service


async def _sample_groups(probe: ConsumerGroupProbe, metrics: OtelMetrics,
                         every_s: float) -> None:
    """Keep ``dsh_consumer_group_members`` current; a failed sample is logged and retried."""
    started = False
    while True:
        try:
            if not started:
                await probe.start()
                started = True
            found = await probe.sample()
        except DshError as exc:
            log.warning("otel: describing the consumer groups failed: %s", exc)
        else:
            metrics.group_members.clear()
            for group in found:
                metrics.group_members.labels(group.group).set(group.members)
        await asyncio.sleep(every_s)


async def _run_until(service: OtelService, stop: asyncio.Event) -> None:
    """Run the loop; a stop request cancels a batch waiting on the receiver (uncommitted,
    so read again at the next start)."""
    loop_task = asyncio.create_task(service.run(stop))
    stop_task = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({loop_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if loop_task in done:
            loop_task.result()
            return
        try:
            await asyncio.wait_for(asyncio.shield(loop_task), 5.0)
        except TimeoutError:
            await cancel_until_done([loop_task])
    finally:
        stop_task.cancel()
