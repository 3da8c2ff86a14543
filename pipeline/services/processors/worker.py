"""The parts of a running processors worker that its views, metrics and timers read
(:class:`Processors`); :func:`.app.build_processors` makes one."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import faust

from pipeline.adapters.faust.transport import awaiting_recovery_seek, table_recovery
from pipeline.adapters.kafka.projection_follow import ProjectionFollow
from pipeline.adapters.loop_probe import LoopProbe
from pipeline.core.fleet import FleetStatus, StepRate, fleet_counters
from pipeline.services.processors.aggregation import UsageAggregator
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.folding import Decoder, SessionFolder
from pipeline.services.processors.options import ProcessorsOptions
from pipeline.services.processors.session_state import SessionTables
from pipeline.settings import Settings


@dataclass(slots=True)
class Processors:
    """The app and the parts its views and timers read."""

    app: faust.App
    settings: Settings
    options: ProcessorsOptions
    tables: SessionTables
    usage_agg: Any
    decode: Decoder | None = None   # the session topic's values (for ?at_seq=)
    aggregator: UsageAggregator | None = None
    folder: SessionFolder | None = None
    follow: ProjectionFollow | None = None
    counters: DeliveryCounters = field(default_factory=DeliveryCounters)
    step_rate: StepRate = field(default_factory=StepRate)
    steps_seen: int = 0
    loop_probe: LoopProbe | None = None   # DSH_LOOP_PROBE=1 (benchmarks): GET /loop-probe

    @property
    def principal(self) -> str:
        """The worker's Kafka principal, named when the broker refuses one of its writes."""
        return self.settings.sasl_username or "ANONYMOUS"

    def active_partitions(self, topic: str) -> set[int]:
        return {tp.partition for tp in self.app.assignor.assigned_actives() if tp.topic == topic}

    def local_fleet(self) -> list[FleetStatus]:
        """Statuses of the sessions whose partitions this worker owns (not standbys)."""
        owned = self.active_partitions(self.settings.topics.session_events)
        statuses = {sid: FleetStatus.from_json(raw["fleet"])
                    for sid, raw in list(self.tables.sessions.items())
                    if raw and raw.get("partition") in owned}
        if self.folder is not None:   # newer than the tables until the next persist
            statuses.update({sid: state.fleet for sid, state in self.folder.states.items()
                             if state.fleet is not None and state.partition in owned})
        return list(statuses.values())

    def observe_steps(self, now_ms: int) -> None:
        """Feed the steps/s rate (called by the tick timer, once a tick)."""
        started = self.counters.steps_started
        self.step_rate.observe(now_ms, started - self.steps_seen)
        self.steps_seen = started

    def fleet_summary(self) -> dict[str, Any]:
        now_ms = int(time.time() * 1000)
        statuses = self.local_fleet()
        counters = fleet_counters(statuses, now_ms=now_ms,
                                  active_within_ms=self.options.active_within_ms,
                                  steps_per_second=self.step_rate.per_second())
        return counters.to_json()

    def tables_epoch(self) -> int | None:
        """Which settled state the tables are in: faust's count of rebalances, from the end of
        one's recovery (and the seek after it) to the start of the next; None in between.

        None from the very start of a rebalance (faust's ``rebalancing``, set in its consumer
        thread before it asks for the new assignment), not only during the recovery: the
        assignor shows the new partitions (:meth:`active_partitions`) before faust's
        ``on_partitions_assigned`` reaches the event loop, and the recovery, the only other
        writer of the tables, starts only after that."""
        if self.app.rebalancing or self.recovery()["in_recovery"]:
            return None
        return int(self.app.rebalancing_count)

    def recovery(self) -> dict[str, Any]:
        """Recovery progress. ``in_recovery`` lasts until the batched partitions are
        consumed again: faust ends its recovery before its seek to the committed offsets,
        and those partitions wait for that seek (:mod:`pipeline.adapters.faust.transport`)."""
        recovery = table_recovery(self.app)
        by_tp = {f"{tp.topic}[{tp.partition}]": int(n)
                 for tp, n in recovery.active_remaining().items() if n}
        seeking = awaiting_recovery_seek(self.app)
        return {"in_recovery": bool(recovery.in_recovery) or seeking,
                "active_remaining": int(recovery.active_remaining_total()),
                "standby_remaining": int(recovery.standby_remaining_total()),
                "active_remaining_by_partition": by_tp}
