"""The driver service: a consumer group on the inbox that runs agent turns.

Ownership: inbox and session topic are co-partitioned (same partition count, same murmur2
partitioner, key = session id), so the member assigned inbox partition p owns every session
whose events live in partition p of the session topic, and is their only writer: its
transactional producer (``<group>-driver-p<p>``) fences every older owner of p.

What is atomic (one Kafka transaction of p's producer, see ``kafka_sink``): a batch of
events of p's sessions (at most ``linger_ms`` old, or up to a step boundary), the dead
letters of bad inbox records, and the inbox offset of p up to which every command's effect
is logged. A message command is "logged" when its ``agent/inbox/spliced`` record is in the
batch, a configure when its ``dsh-pipeline/config`` record is (the configuration it leaves,
which a rebuild restores); a cancel when its session's runner went idle after it.

On a crash between transactions: events not committed are lost (readers never saw them:
they read committed); the next owner fences the dead producer (its open transaction is
aborted), loads each busy session from its checkpoint (the fold of exactly the committed
events, written in the same transactions: ``takeover``, docs/driver-state.md), writes
crash-repair closers for an open turn (``turn/end interrupted``), and gets every command
after the committed inbox offset again. Commands whose message id entered the session are
skipped; the checkpoint holds the inbox lists and the configuration, so queued work
continues as configured. A cancel leaves no id in the log: those applied beyond
the commit point are named in the commit's metadata (same transaction) and skipped too.

Eager rebalances (aiokafka has no cooperative protocol): on revocation nothing is torn
down; on the following assignment partitions no longer assigned are released (their turns
stopped at the next await point, buffered events committed if the producer is not fenced
yet, producer closed) and new ones are built in background tasks while paused. Kept
partitions carry on: a member that lost a partition in between would have been fenced.

No inbox record is skipped: an owner gets its partition's records from the committed offset
on. Records fetched while a partition builds are dropped, so the poll loop seeks the partition
to its committed offset in the step that adopts the build, between two polls, in the
consumer's current assignment; a kept partition's new assignment starts at the group's
committed offset, which only its owner moves. The seek is not made by the build task: the
poll blocks while the group rebalances, so a build can end during a rebalance, and a seek made
then holds for the assignment being replaced while the blocked poll returns the new
assignment's records, dropped, before the build is adopted. The owner's first record would
then lie past them, and its commit point (``InboxOffsets``: gaps are normal, transaction
markers take offsets) would pass commands that never entered their session.

A partition whose producer is fenced is given up until the next assignment: usually another
member owns it in a newer generation, and that assignment is under way. A fence can also come
from no owner (another member's build that its rebalance cancelled after the build had sent
its producer's initialisation, which reached the broker after this member's), and then no
rebalance would follow: so a member fenced on a partition its assignment still holds rejoins
the group, and the answer (a rebalance, or its assignment confirmed) rebuilds the partition
if it is still this member's.

Backpressure: when more than ``max_turns_in_flight`` sessions are running a turn, every
partition is paused; fetching resumes once no more than ``resume_below`` are running.

Memory: the service runs under the driver's collector policy (``gc_tuning``): the sessions of
a newly built partition are frozen out of garbage collection, and so is whatever is live every
minute; a released partition unfreezes them so they can be collected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from pipeline.adapters.cancelling import cancel_until_done
from pipeline.adapters.kafka.errors import is_refusal
from pipeline.adapters.kafka.inbox_consumer import InboxConsumer
from pipeline.adapters.kafka.records import InboxRecord
from pipeline.adapters.kafka.transactional import FencedError
from pipeline.core.errors import ConfigError, DshError
from pipeline.services.driver.gc_tuning import DriverGc, driver_gc
from pipeline.services.driver.partition import (
    DriverMetrics,
    OwnedPartition,
    PartitionContext,
)
from pipeline.services.driver.takeover import build_partition

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DriverConfig:
    """Tuning of the driver; defaults suit a laptop and a small cluster."""

    linger_ms: float = 25.0
    max_turns_in_flight: int = 256
    resume_below: int = 192
    shutdown_grace_s: float = 10.0
    poll_timeout_ms: int = 100
    rebuild_retry_s: float = 2.0
    session_timeout_ms: int = 3_000  # a killed driver's partitions move within 5 s
    instance_id: str | None = None  # static membership: a restart keeps the assignment

    def __post_init__(self) -> None:
        if not 0 <= self.resume_below < self.max_turns_in_flight:
            raise ConfigError(f"driver resume_below ({self.resume_below}) must be below "
                              f"max_turns_in_flight ({self.max_turns_in_flight}) and >= 0")
        if self.linger_ms < 0:
            raise ConfigError(f"driver linger_ms must be >= 0, got {self.linger_ms}")


class DriverService:
    """Runs until ``stop`` is set, then shuts down gracefully and leaves the group."""

    def __init__(self, ctx: PartitionContext, config: DriverConfig | None = None) -> None:
        self.ctx = ctx
        self.config = config or DriverConfig()
        self.metrics: DriverMetrics = ctx.metrics
        self.owned: dict[int, OwnedPartition] = {}
        self._building: dict[int, asyncio.Task[OwnedPartition]] = {}
        self._assigned: set[int] = set()
        self._given_up: set[int] = set()  # fenced: wait for the next assignment
        self._rejoining = False  # rejoined the group for a fenced partition, not answered yet
        self._throttled = False
        self._consumer: InboxConsumer | None = None
        self.ready = asyncio.Event()  # set once every assigned partition is built
        self._running = False
        self._last_loop = 0.0
        self._gc = DriverGc()  # replaced by run()'s policy

    async def run(self, stop: asyncio.Event) -> None:
        """Poll the inbox until ``stop`` is set, under the driver's collector policy."""
        with driver_gc() as self._gc:
            await self._run(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        settings = self.ctx.settings
        self._consumer = InboxConsumer(
            settings, topic=settings.topics.inbox, group_id=self.ctx.group_id,
            on_assigned=self._on_assigned, on_revoked=self._on_revoked,
            session_timeout_ms=self.config.session_timeout_ms,
            group_instance_id=self.config.instance_id)
        await self._consumer.start()
        self._running = True
        try:
            while not stop.is_set():
                self._last_loop = time.monotonic()
                self._gc.tick()
                await self._collect_builds()
                await self._check_sinks()
                self._apply_pauses()
                for record in await self._consumer.poll(self.config.poll_timeout_ms):
                    self._handle(record)
        finally:
            self._running = False
            await self._shutdown()

    def health(self, stall_s: float = 60.0) -> tuple[bool, dict[str, object]]:
        """Alive while the poll loop turns (a liveness probe); details for operators."""
        alive = self._running and time.monotonic() - self._last_loop < stall_s
        return alive, {"ready": self.ready.is_set(), "group": self.ctx.group_id,
                       "partitions": sorted(self.owned),
                       "building": sorted(self._building)}

    def metrics_snapshot(self) -> dict[str, int]:
        """Counters plus live gauges (owned partitions, turns in flight, throttled)."""
        snap = self.metrics.snapshot()
        snap["events_committed"] += sum(o.sink.events_committed for o in self.owned.values())
        snap["transactions"] += sum(o.producer.transactions_committed
                                    for o in self.owned.values())
        snap["transactions_aborted"] += sum(o.sink.transactions_aborted
                                            for o in self.owned.values())
        snap["checkpoints_written"] += sum(o.sink.plan.written for o in self.owned.values())
        snap["partitions_owned"] = len(self.owned)
        snap["sessions_in_memory"] = sum(len(o.sessions) for o in self.owned.values())
        snap["sessions_indexed"] = sum(len(o.index) for o in self.owned.values())
        snap["session_records_read"] = self.ctx.checkpoints.session_records_read
        snap["checkpoint_records_read"] = self.ctx.checkpoints.checkpoint_records_read
        snap["tail_records_read"] = self.ctx.checkpoints.tail_records_read
        snap["turns_in_flight"] = self.turns_in_flight
        snap["throttled"] = int(self._throttled)
        snap["ready"] = int(self.ready.is_set())
        gate = self.ctx.gate
        if gate is not None:   # calls waiting for the provider's budget, and how long they did
            snap["provider_waiting"] = gate.counters.waiting
            snap["provider_grants"] = gate.counters.grants
            snap["provider_wait_ms"] = int(gate.counters.waited_s * 1000)
            snap["provider_wait_ms_longest"] = int(gate.counters.longest_wait_s * 1000)
        router = self.ctx.router
        if router is not None:  # calls moved to a fallback, steps that started on one
            snap["provider_failovers"] = router.counters.failovers
            snap["provider_fallback_steps"] = router.counters.fallback_steps
        return snap

    # -- group membership ----------------------------------------------------------------

    async def _on_revoked(self, partitions: list[int]) -> None:
        log.info("inbox partitions revoked: %s (kept running until the next assignment)",
                 partitions)

    async def _on_assigned(self, partitions: list[int]) -> None:
        assigned = set(partitions)
        log.info("inbox partitions assigned: %s", sorted(assigned))
        self._assigned = assigned
        if self.ctx.gate is not None and assigned:   # the fleet's limits, shared by partitions
            self.ctx.gate.reshare(len(assigned) / self.ctx.settings.partitions)
        self._given_up.clear()
        self._rejoining = False
        for partition in sorted(set(self.owned) - assigned):
            self.metrics.partitions_lost += 1
            lost = self.owned.pop(partition, None)
            if lost is not None:
                await lost.release(grace_s=0)
                self._gc.release()
        for partition in sorted(set(self._building) - assigned):
            building = self._building.pop(partition, None)
            if building is not None:
                await _drop_build(building)
        for partition in sorted(assigned - set(self.owned) - set(self._building)):
            self._start_build(partition)
        self._update_ready()

    def _start_build(self, partition: int, delay_s: float = 0.0) -> None:
        self._building[partition] = asyncio.create_task(self._build(partition, delay_s),
                                                        name=f"build-p{partition}")
        self.ready.clear()

    async def _build(self, partition: int, delay_s: float) -> OwnedPartition:
        assert self._consumer is not None
        if delay_s:
            await asyncio.sleep(delay_s)
        consumer = self._consumer
        return await build_partition(self.ctx, partition, lambda: consumer.committed(partition))

    async def _collect_builds(self) -> None:
        for partition, task in list(self._building.items()):
            if not task.done():
                continue
            if self._building.get(partition) is not task:
                continue  # a rebalance (callbacks run between our awaits) took it already
            del self._building[partition]
            try:
                owned = task.result()
            except asyncio.CancelledError:
                continue
            except DshError as exc:
                log.error("building inbox partition %d failed: %s; retrying", partition, exc)
                self.metrics.broker_failures += 1
                if partition in self._assigned:
                    self._start_build(partition, self.config.rebuild_retry_s)
                continue
            if partition not in self._assigned:
                await owned.release(grace_s=0)
            elif self._fetch_from_committed(owned):
                self.owned[partition] = owned
                self._gc.freeze()  # its rebuilt logs are long-lived: out of every collection
            else:  # an assignment is being installed; its callback cancels this if p left
                await owned.release(grace_s=0)
                self._start_build(partition, self.config.rebuild_retry_s)
        self._update_ready()

    def _fetch_from_committed(self, owned: OwnedPartition) -> bool:
        """Seek ``owned``'s partition to its committed offset, as it is adopted (see the
        module's docstring: records fetched until now were dropped); False when the consumer
        does not hold the partition."""
        assert self._consumer is not None
        return self._consumer.seek(owned.partition, owned.sink.offsets.committed)

    def _update_ready(self) -> None:
        if not self._building and self._assigned and set(self.owned) >= (
                self._assigned - self._given_up):
            self.ready.set()

    async def _check_sinks(self) -> None:
        """Give up a partition whose producer was fenced; stop the driver when the broker
        refused its writes (the principal lost an ACL: no rebuild can write either; the
        transaction was not committed, so neither were its inbox offsets); rebuild one that
        failed otherwise."""
        for partition, owned in list(self.owned.items()):
            task = owned.sink_task
            if task is None or not task.done():
                continue
            if self.owned.get(partition) is not owned:
                continue  # released by a rebalance meanwhile
            del self.owned[partition]
            error = owned.sink.failure
            if not task.cancelled():
                task.exception()   # retrieved: it is the failure, handled below
            await owned.release(grace_s=0)
            self._gc.release()
            if isinstance(error, FencedError):
                log.warning("inbox partition %d given up: %s", partition, error)
                self.metrics.fenced += 1
                self._given_up.add(partition)
                self._ask_assignment(partition)
            elif error is not None and _refused(error):
                raise error   # the run loop shuts down; the CLI says it, with the principal
            else:
                log.error("inbox partition %d failed (%s); rebuilding it", partition, error)
                self.metrics.broker_failures += 1
                if partition in self._assigned:
                    self._start_build(partition)

    def _ask_assignment(self, partition: int) -> None:
        """A fenced partition the group still assigns here: rejoin the group (once until the
        next assignment), whose answer decides whether it is rebuilt (see the module's
        docstring)."""
        assert self._consumer is not None
        if partition in self._assigned and not self._rejoining:
            log.info("inbox partition %d fenced while assigned here: rejoining the group",
                     partition)
            self._rejoining = True
            self._consumer.rejoin()

    # -- records and backpressure --------------------------------------------------------

    def _handle(self, record: InboxRecord) -> None:
        owned = self.owned.get(record.partition)
        if owned is None or not owned.accepting:
            return  # building or given up: fetched again from the committed offset
        owned.handle(record)

    @property
    def turns_in_flight(self) -> int:
        return sum(owned.turns_in_flight for owned in self.owned.values())

    def _apply_pauses(self) -> None:
        assert self._consumer is not None
        in_flight = self.turns_in_flight
        if not self._throttled and in_flight >= self.config.max_turns_in_flight:
            self._throttled = True
            self.metrics.pauses += 1
        elif self._throttled and in_flight <= self.config.resume_below:
            self._throttled = False
        assigned = self._consumer.assigned()
        ready = {p for p, owned in self.owned.items() if owned.accepting}
        paused = assigned if self._throttled else assigned - ready
        if paused != self._consumer.paused():
            self._consumer.pause(paused)
            self._consumer.resume(assigned - paused)

    # -- shutdown ------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Stop claiming, let turns finish (grace), commit or abort, close, leave the group."""
        for task in await cancel_until_done(self._building.values()):
            if task.cancelled():
                continue
            error = task.exception()
            if error is None:  # it finished before the cancellation
                await task.result().release(grace_s=0)
            elif not isinstance(error, DshError):
                raise error
        self._building.clear()
        owned_now = list(self.owned.values())
        self.owned.clear()
        await asyncio.gather(*(o.release(grace_s=self.config.shutdown_grace_s)
                               for o in owned_now), return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()
        await self.ctx.checkpoints.close()


async def _drop_build(task: asyncio.Task[OwnedPartition]) -> None:
    """Stop a build no longer wanted. One that has finished (during a rebalance, before the
    poll loop collected it) ignores a cancellation: its partition is released, or its
    producer, sink and session tasks would run on unowned."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        await task.result().release(grace_s=0)


def _refused(error: BaseException) -> bool:
    """Whether ``error`` is, or was raised handling, an authorization refusal."""
    seen: BaseException | None = error
    while seen is not None:
        if is_refusal(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
