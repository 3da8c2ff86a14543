"""The dashboard service: the processors' outputs plus the live tail, feeding model and streams.

The session topic is kept forever, so the dashboard never reads it from the beginning
(DESIGN.md section 6a). Four background loops run beside the web server:

- the **outputs** loop reads ``<prefix>fleet`` and ``<prefix>usage`` (compacted, published by
  the processors) up to the end offsets taken at its start, read committed: then the fleet
  is shown (``ready``), and the loop follows both topics live. Its cost is the size of the
  compacted outputs, not the history;
- the **tail** reads every partition of the session topic from its end at start-up (no
  consumer group: each dashboard sees the whole fleet), for the charts of what happens now
  and for the open session pages' live events; a broker failure restarts it where it was;
- the **broadcaster** pushes the changed rows every ``push_interval_s`` and the charts once a
  second to the fleet streams;
- the **lag probe** samples consumer lag per group and partition every ``lag_interval_s``, and
  whether the processors' consumer group has members: without a processors worker nothing
  new reaches the outputs, which the page and ``/health`` say.

Records of these topics that do not decode are counted and shown (``/health``), never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from pipeline.adapters.cancelling import cancel_until_done
from pipeline.adapters.kafka.compacted import CompactedFollow
from pipeline.adapters.kafka.errors import is_transient
from pipeline.adapters.kafka.event_stream import Decoder
from pipeline.adapters.kafka.groups import group_members
from pipeline.adapters.kafka.records import InboxRecord
from pipeline.adapters.metrics.consumer_lag import ConsumerLagProbe, leaders_ready
from pipeline.adapters.processors_web import ProcessorsWeb
from pipeline.adapters.registry.outputs import output_decoder
from pipeline.codec.output_views import OutputView
from pipeline.codec.outputs import FLEET_STATUS, USAGE_RECORD, OutputDecoder
from pipeline.core.errors import BrokerError, DshError
from pipeline.services.dashboard.hub import Hub
from pipeline.services.dashboard.model import FleetModel
from pipeline.settings import Settings

log = logging.getLogger(__name__)

PROBLEMS_SHOWN: Final = 5


def now_ms() -> int:
    return int(time.time() * 1000)


def group_label(settings: Settings, group: str) -> str:
    """A group id without the deployment's prefixes (``dsh-dsh.processors`` -> ``processors``)."""
    label = group.removeprefix(settings.group_id_prefix)
    return label.removeprefix(settings.topic_prefix) or group


@dataclass(frozen=True, slots=True)
class DashboardConfig:
    push_interval_s: float = 0.2
    chart_interval_s: float = 1.0
    lag_interval_s: float = 5.0
    retry_s: float = 2.0
    # how long the processors' group may answer "starting" before it is a warning
    starting_grace_s: float = 60.0


@dataclass(slots=True)
class ProcessorsCheck:
    """What the dashboard says when it cannot describe the processors' consumer group.

    A transient answer is a group that is starting: its coordinator not elected yet or still
    loading the group's offsets (``GroupCoordinatorNotAvailableError``,
    ``CoordinatorLoadInProgressError``, ``NotCoordinatorError``: a broker that has just
    started, as in ``make demo``, or a coordinator that moves), or the broker out of reach
    for a moment. That is said at info level once, and the next check asks again; only when
    it lasts longer than ``grace_ms`` is it a warning. Any other failure (a refusal: the
    dashboard's principal may not Describe the group) is a warning at once.
    """

    grace_ms: int
    starting_since_ms: int | None = None

    def answered(self) -> None:
        self.starting_since_ms = None

    def failed(self, exc: DshError, now_ms: int) -> tuple[int, str]:
        """The log level and line for ``exc``, raised by a check at ``now_ms``."""
        if not (isinstance(exc, BrokerError) and is_transient(exc)):
            self.starting_since_ms = None
            return logging.WARNING, f"dashboard: cannot tell whether processors run: {exc}"
        first = self.starting_since_ms is None
        if self.starting_since_ms is None:
            self.starting_since_ms = now_ms
        waited_ms = now_ms - self.starting_since_ms
        if waited_ms <= self.grace_ms:
            return (logging.INFO if first else logging.DEBUG,
                    f"dashboard: no answer about the processors' consumer group yet (a group "
                    f"or broker starting), asking again: {exc}")
        return logging.WARNING, (f"dashboard: cannot tell whether processors run: {exc} "
                                 f"(for {waited_ms / 1000:.0f} s)")


@dataclass(slots=True)
class SessionTopicReads:
    """Every session-topic record the dashboard was handed (the tail, session pages): the
    first offset per partition and how many. What it proves: nothing older was read."""

    first: dict[int, int] = field(default_factory=dict)
    records: int = 0

    def saw(self, partition: int, offset: int) -> None:
        self.records += 1
        if offset < self.first.get(partition, offset + 1):
            self.first[partition] = offset


class DashboardService:
    """Owns the model, the hub and the loops; the web app reads from it."""

    def __init__(self, settings: Settings, decode: Decoder,
                 config: DashboardConfig | None = None,
                 clock: Callable[[], int] = now_ms,
                 outputs: OutputDecoder | None = None) -> None:
        self.settings = settings
        self.decode = decode
        self.config = config or DashboardConfig()
        self.clock = clock
        self.outputs = outputs or output_decoder(settings)  # registry ids resolved lazily
        self.model = FleetModel()
        self.hub = Hub()
        self.feed_error: str | None = None      # the tail of the session topic
        self.outputs_error: str | None = None   # the fleet and usage outputs
        self.processors_workers: int | None = None
        self.processors_check = ProcessorsCheck(int(self.config.starting_grace_s * 1000))
        self.ready_s: float | None = None       # seconds from start to the fleet shown
        self.tail_start: dict[int, int] = {}    # partition -> the end the tail started at
        self.processors_web: ProcessorsWeb | None = None  # session pages' first source
        self.reads = SessionTopicReads()
        self.events_read = 0
        self.problems: list[str] = []           # the last undecodable records, described
        self.tail_undecodable = 0               # session-topic records the tail could not read
        self.views = {settings.topics.fleet: OutputView(self.outputs, FLEET_STATUS),
                      settings.topics.usage: OutputView(self.outputs, USAGE_RECORD)}
        self._started = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._started = time.monotonic()
        loops = {"outputs": self._outputs(), "tail": self._tail(),
                 "broadcast": self._broadcast(), "lag": self._lag()}
        self._tasks = [asyncio.create_task(c, name=f"dashboard-{n}") for n, c in loops.items()]

    async def stop(self) -> None:
        """Cancel the loops until they have ended (:func:`cancel_until_done`: a cancellation
        can be lost inside a client call, and a loop would go on to its retry sleep)."""
        tasks, self._tasks = self._tasks, []
        for task in await cancel_until_done(tasks):
            if not task.cancelled() and task.exception() is not None:
                log.warning("dashboard loop ended with %r", task.exception())
        if self.processors_web is not None:
            await self.processors_web.close()

    @property
    def processors_error(self) -> str | None:
        if self.processors_workers is None or self.processors_workers > 0:
            return None
        return (f"no processors worker is running (consumer group "
                f"{self.settings.processors_group()!r} has no members): the fleet shows what "
                "they last published and nothing newer; start `dsh-pipeline processors`")

    @property
    def undecodable(self) -> int:
        return sum(v.undecodable for v in self.views.values()) + self.tail_undecodable

    def problem(self, line: str) -> None:
        self.problems = [*self.problems[-(PROBLEMS_SHOWN - 1):], line]

    # --- the outputs -----------------------------------------------------------------

    async def _outputs(self) -> None:
        topics = [self.settings.topics.fleet, self.settings.topics.usage]
        while True:
            try:
                async with CompactedFollow(self.settings, topics) as follow:
                    if follow.missing:
                        self._outputs_failed(
                            f"topics {follow.missing} do not exist yet: the processors create "
                            "and fill them (start `dsh-pipeline processors`)", logging.INFO)
                    else:
                        await self._read_outputs(follow)
            except DshError as exc:
                self._outputs_failed(str(exc), logging.WARNING)
            await asyncio.sleep(self.config.retry_s)

    async def _read_outputs(self, follow: CompactedFollow) -> None:
        async for batch in follow.snapshot():
            self._apply_outputs(batch)
        self.outputs_error = None
        if self.ready_s is None:
            self.ready_s = time.monotonic() - self._started
            log.info("dashboard: fleet read from the outputs in %.2f s (%d records)",
                     self.ready_s, follow.snapshot_records)
        async for batch in follow.changes():
            self._apply_outputs(batch)

    def _apply_outputs(self, batch: list[InboxRecord]) -> None:
        fleet = self.settings.topics.fleet
        for record in batch:
            view = self.views[record.topic]
            self.model.metrics.output_records.labels(topic=record.topic).inc()
            change = view.apply(record)
            if change is None:
                self.model.metrics.undecodable.labels(topic=record.topic).inc()
                self.problem(view.problems[-1])
            elif record.topic == fleet:
                self.model.apply_fleet(change)
            else:
                self.model.apply_usage(change)

    def _outputs_failed(self, why: str, level: int) -> None:
        if why != self.outputs_error:  # once per distinct problem, not every retry
            log.log(level, "dashboard outputs: %s; retrying every %.0f s", why,
                    self.config.retry_s)
        self.outputs_error = why

    # --- the live tail ---------------------------------------------------------------

    async def _tail(self) -> None:
        positions: dict[tuple[str, int], int] = {}
        topic = self.settings.topics.session_events
        while True:
            try:
                if await leaders_ready(self.settings, topic):
                    await self._read_tail(positions)
                else:
                    # normal while a stack starts: the page shows it, the log stays quiet
                    self._failed(f"topic {topic!r} does not exist yet (or has no leader)",
                                 logging.INFO)
            except DshError as exc:
                self._failed(str(exc), logging.WARNING)
            await asyncio.sleep(self.config.retry_s)

    def _failed(self, why: str, level: int) -> None:
        if why != self.feed_error:  # once per distinct problem, not every retry
            self.model.metrics.feed_errors.inc()
            log.log(level, "dashboard tail: %s; retrying every %.0f s", why, self.config.retry_s)
        self.feed_error = why

    async def _read_tail(self, positions: dict[tuple[str, int], int]) -> None:
        model, hub, metrics = self.model, self.hub, self.model.metrics
        topic = self.settings.topics.session_events
        # where the first start found the end, unless read further since: a restart of the
        # tail loses nothing after the dashboard's start
        resume = {**{(topic, p): end for p, end in self.tail_start.items()}, **positions}
        async with CompactedFollow(self.settings, [topic], live_only=True,
                                   resume=resume) as tail:
            for tp, end in tail.ends.items():
                self.tail_start.setdefault(tp.partition, end)
            self.feed_error = None
            async for batch in tail.changes():
                for record in batch:
                    positions[(topic, record.partition)] = record.offset + 1
                    metrics.feed_offset.labels(partition=str(record.partition)).set(
                        record.offset + 1)
                    self.reads.saw(record.partition, record.offset)
                    try:
                        session_id, event = self.decode(record.value or b"")
                    except DshError as exc:
                        metrics.undecodable.labels(topic=topic).inc()
                        self.tail_undecodable += 1
                        self.problem(f"{topic}[{record.partition}]@{record.offset}: "
                                     f"{str(exc)[:200]}")
                        continue
                    model.apply_event(session_id, event)
                    hub.publish_event(session_id, event)
                    self.events_read += 1

    # --- pushing, lag and the processors ---------------------------------------------

    async def _broadcast(self) -> None:
        config, model, hub = self.config, self.model, self.hub
        next_chart = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(config.push_interval_s)
            rows = model.take_changed()
            if rows:
                hub.publish_fleet("sessions", rows)
                for row in rows:
                    hub.publish_row(str(row["session_id"]), row)
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
                    await self._check_processors()
                    samples = await probe.sample(self.clock())
                    self.model.set_lag([{**s.to_json(), "name": group_label(self.settings,
                                                                            s.group)}
                                        for s in samples])
                    self.model.set_partition_ends(probe.ends)
                    await asyncio.sleep(self.config.lag_interval_s)
            except DshError as exc:
                log.warning("dashboard lag probe: %s", exc)
            finally:
                with contextlib.suppress(Exception):  # closing a half-started client
                    await probe.stop()
            await asyncio.sleep(self.config.lag_interval_s)

    async def _check_processors(self) -> None:
        try:
            self.processors_workers = await group_members(self.settings,
                                                          self.settings.processors_group())
        except DshError as exc:
            self.processors_workers = None
            level, line = self.processors_check.failed(exc, self.clock())
            log.log(level, "%s", line)
        else:
            self.processors_check.answered()
        self.model.metrics.processors.set(-1 if self.processors_workers is None
                                          else self.processors_workers)
