"""The dashboard service: one reader of the session topic feeding the model and the streams.

Three background loops run beside the web server:

- the **feed** reads every partition of the session topic from the beginning (no consumer
  group: each dashboard sees the whole fleet, whatever the number of processors workers) with
  the consumer SDK, folds each event into :class:`FleetModel` and hands it to the session
  streams; a broker failure is logged and the feed restarts from where it was;
- the **broadcaster** pushes the changed rows every ``push_interval_s`` and the charts once a
  second to the fleet streams;
- the **lag probe** samples consumer lag per group and partition every ``lag_interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from pipeline.adapters.kafka.event_stream import Decoder, EventStream, Start
from pipeline.adapters.metrics.consumer_lag import ConsumerLagProbe, leaders_ready
from pipeline.core.errors import DshError
from pipeline.core.events import Event
from pipeline.services.dashboard.hub import Hub
from pipeline.services.dashboard.model import FleetModel
from pipeline.settings import Settings

log = logging.getLogger(__name__)


UNDECODABLE: Final = "dashboard/undecodable"


def now_ms() -> int:
    return int(time.time() * 1000)


def tolerant(decode: Decoder) -> Decoder:
    """``decode``, but a record it refuses becomes an ``UNDECODABLE`` marker event, so one
    foreign or corrupt record is counted and skipped instead of stopping the feed for good."""
    def decode_or_mark(data: bytes) -> tuple[str, Event]:
        try:
            return decode(data)
        except DshError as exc:
            return "", Event(UNDECODABLE, -1, 0, str(exc)[:300])
    return decode_or_mark


@dataclass(frozen=True, slots=True)
class DashboardConfig:
    push_interval_s: float = 0.2
    chart_interval_s: float = 1.0
    lag_interval_s: float = 5.0
    retry_s: float = 2.0


class DashboardService:
    """Owns the model, the hub and the loops; the web app reads from it."""

    def __init__(self, settings: Settings, decode: Decoder,
                 config: DashboardConfig | None = None,
                 clock: Callable[[], int] = now_ms) -> None:
        self.settings = settings
        self.decode = decode
        self.config = config or DashboardConfig()
        self.clock = clock
        self.model = FleetModel()
        self.hub = Hub()
        self.feed_error: str | None = None
        self.events_read = 0
        self.last_undecodable: str | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._feed(), name="dashboard-feed"),
                       asyncio.create_task(self._broadcast(), name="dashboard-broadcast"),
                       asyncio.create_task(self._lag(), name="dashboard-lag")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _feed(self) -> None:
        positions: dict[int, int] = {}
        topic = self.settings.topics.session_events
        while True:
            try:
                if await leaders_ready(self.settings, topic):
                    await self._read(positions)
                else:
                    # normal while a stack starts: the page shows it, the log stays quiet
                    self._failed(f"topic {topic!r} does not exist yet (or has no leader)",
                                 logging.INFO)
            except DshError as exc:
                self._failed(str(exc), logging.WARNING)
            await asyncio.sleep(self.config.retry_s)

    def _failed(self, why: str, level: int) -> None:
        if why != self.feed_error:  # once per distinct problem, not every retry
            log.log(level, "dashboard feed: %s; retrying every %.0f s", why, self.config.retry_s)
        self.feed_error = why

    async def _read(self, positions: dict[int, int]) -> None:
        model, hub = self.model, self.hub
        stream = EventStream(self.settings, decode=tolerant(self.decode), start=Start.BEGINNING)
        async with stream:
            self.feed_error = None
            async for record in stream:
                if record.offset < positions.get(record.partition, 0):
                    continue  # re-read after a restart of the feed
                positions[record.partition] = record.offset + 1
                model.metrics.feed_offset.set(record.offset + 1, partition=str(record.partition))
                if record.event.type == UNDECODABLE:
                    model.metrics.undecodable.inc()
                    self.last_undecodable = f"{record.topic}[{record.partition}]@" \
                                            f"{record.offset}: {record.event.data}"
                    continue
                model.apply(record.session_id, record.event, record.partition)
                hub.publish_event(record.session_id, record.event)
                self.events_read += 1

    async def _broadcast(self) -> None:
        config, model, hub = self.config, self.model, self.hub
        next_chart = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(config.push_interval_s)
            rows = model.take_changed()
            if rows:
                hub.publish_fleet("sessions", rows)
            if loop.time() >= next_chart:
                next_chart = loop.time() + config.chart_interval_s
                model.tick(self.clock())
                model.metrics.sse_clients.set(hub.clients)
                if hub.fleet:
                    hub.publish_fleet("charts", model.charts(self.clock()))

    async def _lag(self) -> None:
        topics = (self.settings.topics.session_events, self.settings.topics.inbox)
        while True:
            probe = ConsumerLagProbe(self.settings, topics)
            try:
                await probe.start()
                while True:
                    samples = await probe.sample(self.clock())
                    self.model.set_lag([s.to_json() for s in samples])
                    await asyncio.sleep(self.config.lag_interval_s)
            except DshError as exc:
                log.warning("dashboard lag probe: %s", exc)
            finally:
                with contextlib.suppress(Exception):  # closing a half-started client
                    await probe.stop()
            await asyncio.sleep(self.config.lag_interval_s)
