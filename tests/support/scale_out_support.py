"""The scale-out run (issue 9 item 4): shared by ``tests/system/test_scale_out.py`` (the small
version, with assertions) and ``bench/bench_scale_out.py`` (the full one, with figures).

One run, on a Kafka cluster (the local 3-node one, :func:`local_cluster`, or a given one):

1. fresh topics under a unique prefix (``plan.partitions`` partitions, replication factor
   ``min(3, brokers)``; the local cluster has ``min.insync.replicas=2``);
2. ``plan.drivers`` ``dsh-pipeline driver`` processes (scripted provider, ``--script
   tool-loop``: each turn calls the echo tool, then answers its result: two steps) and
   ``plan.workers`` ``dsh-pipeline processors`` workers, each a localstack
   :class:`ChildProcess` in its own process group; the run starts once every driver is ready,
   the driver group's assignment covers every partition once and every worker owns partitions;
3. ``plan.turns`` follow-ups per session on the inbox, then the session topic followed
   read_committed (by header, decoding only ``turn/end``) until every session has ended that
   many turns; when ``plan.kill_at`` of the turns have ended, driver 1 and worker 1 get
   SIGKILL (their whole process group), and the survivors' takeover is timed;
4. the drivers are stopped (SIGTERM: their final counters say how many sessions moved);
5. verification: the ``check`` logic over the whole topic (every log valid, seq contiguous,
   no open turn at all, every tool call answered), the surviving worker's tables against
   core's folds of every log (derived messages, usage, model totals), and the compacted
   derived-messages topic the workers wrote against a replay of the session topic (the
   rebuild's fold into a new version, compared as ``dsh-pipeline replay`` compares).

CPU is read from ``/proc`` for every child (drivers, workers, brokers when local) between
the first inbox send and the last turn's end, so the figures hold on a shared machine.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from scale_out_fleet import (
    Fleet,
    Log,
    ScaleOutPlan,
    covers,
    driver_partitions,
    load_average,
    local_cluster,
    process_cpu_s,
    start_fleet,
    wait_until,
    worker_partitions,
)
from scale_out_verify import verify_run

from dsh_dev.cli.demo_fleet import turn_text
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.codec.records import HEADER_TYPE, session_id_of_key
from pipeline.core.inbox import FollowUp
from pipeline.services.driver.fleet_run import followups
from pipeline.settings import Settings

__all__ = ["ScaleOutPlan", "local_cluster", "run_scale_out"]


async def broker_count(bootstrap: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return len((await admin.describe_cluster()).get("brokers", []))
    finally:
        await admin.close()


async def run_settings(bootstrap: str, plan: ScaleOutPlan, state_dir: Path) -> Settings:
    """Settings of a fresh run: its own topics, groups and state folder."""
    prefix = f"so{secrets.token_hex(4)}."
    replication = min(3, await broker_count(bootstrap))
    return Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                             partitions=plan.partitions, replication_factor=replication,
                             group_id_prefix=f"{prefix}g-", state_dir=str(state_dir))

# -- following the session topic ---------------------------------------------------------


@dataclass(slots=True)
class Progress:
    """What the read_committed follower has seen so far."""

    waiting: Counter[str]  # session -> turns still to end
    turns_total: int
    sessions: list[str] = field(default_factory=list)
    turns_ended: int = 0
    steps: int = 0
    events: int = 0
    end_kinds: Counter[str] = field(default_factory=Counter)
    interrupted: Counter[int] = field(default_factory=Counter)  # partition -> turns
    first_event: float = 0.0
    last_end: float = 0.0
    kill_ms: int | None = None
    resumed_ms: dict[int, int] = field(default_factory=dict)  # partition -> first write after


async def follow(settings: Settings, progress: Progress,
                 on_turn_end: Callable[[Progress], None]) -> None:
    """Read the session topic read_committed until every session ended its turns."""
    serde, topic = EventSerde(), settings.topics.session_events
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=None,
                                isolation_level="read_committed", enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        while progress.waiting:
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            for tp, records in batch.items():
                for record in records:
                    if _see(progress, tp.partition, record, serde):
                        on_turn_end(progress)
    finally:
        await consumer.stop()


def _see(progress: Progress, partition: int, record: Any, serde: EventSerde) -> bool:
    """Count one record (by its type header); True when it ended a turn."""
    progress.events += 1
    if not progress.first_event:
        progress.first_event = time.perf_counter()
    if progress.kill_ms is not None and record.timestamp > progress.kill_ms:
        # Written after the kill (CreateTime of a live producer): the partition works again.
        progress.resumed_ms.setdefault(partition, record.timestamp)
    type_ = dict(record.headers).get(HEADER_TYPE)
    if type_ == b"step/end":
        progress.steps += 1
        return False
    if type_ != b"turn/end":
        return False
    _sid, event = serde.decode(record.value)
    kind = str(event.data.get("reason", {}).get("kind"))
    progress.end_kinds[kind] += 1
    progress.interrupted[partition] += kind == "interrupted"
    session_id = session_id_of_key(record.key)
    if progress.waiting[session_id] > 0:
        progress.waiting[session_id] -= 1
        if progress.waiting[session_id] == 0:
            del progress.waiting[session_id]
    progress.turns_ended += 1
    progress.last_end = time.perf_counter()
    return True


# -- one run -----------------------------------------------------------------------------


@dataclass(slots=True)
class Killing:
    """Driver 1 and worker 1 killed once enough turns ended; the survivors' takeover timed."""

    fleet: Fleet
    plan: ScaleOutPlan
    log: Log
    settings: Settings
    moved_partitions: list[int] = field(default_factory=list)
    late_sessions: list[str] = field(default_factory=list)
    task: asyncio.Task[dict[str, float]] | None = None

    def maybe_kill(self, progress: Progress) -> None:
        fraction = self.plan.kill_at
        if fraction is None or self.task is not None or \
                progress.turns_ended < fraction * progress.turns_total:
            return
        driver, worker = self.fleet.drivers[0], self.fleet.workers[0]
        body = driver.health() or {}
        self.moved_partitions = list(body.get("partitions", []))
        progress.kill_ms = int(time.time() * 1000)
        driver.kill9()
        worker.kill9()
        self.log(f"SIGKILL {driver.name} (pid {driver.process.pid}, partitions "
                 f"{self.moved_partitions}) and {worker.name} (pid {worker.process.pid}) "
                 f"after {progress.turns_ended}/{progress.turns_total} turns")
        self.late_sessions = self._late_sessions(progress)
        for session_id in self.late_sessions:
            progress.waiting[session_id] += 1
            progress.turns_total += 1
        self.task = asyncio.create_task(self._takeover())

    def _late_sessions(self, progress: Progress) -> list[str]:
        """``plan.turns_after_kill`` sessions of the killed driver's partitions, those whose
        turns all ended first (their checkpoints exist, none of them is busy)."""
        parts, moved = self.plan.partitions, set(self.moved_partitions)
        ours = [s for s in progress.sessions if partition_for(s, parts) in moved]
        ours.sort(key=lambda s: progress.waiting[s] > 0)  # the idle ones first
        return ours[:self.plan.turns_after_kill]

    async def _send_late_turns(self) -> None:
        codec, inbox, turn = InboxCodec(), self.settings.topics.inbox, self.plan.turns
        commands = [FollowUp(s, f"{s}-m{turn}", ({"type": "text", "text": turn_text(s, turn)},))
                    for s in self.late_sessions]
        await send_records(self.settings, [OutRecord(inbox, c.session_id.encode(), codec.encode(c))
                                           for c in commands], timeout_s=120.0)
        self.log(f"one more turn for {len(commands)} sessions of the killed driver's partitions")

    async def _takeover(self) -> dict[str, float]:
        """Seconds from the kill until the survivors own every partition (both at once)."""
        if self.late_sessions:
            await self._send_late_turns()
        parts, fleet, budget = self.plan.partitions, self.fleet, 4 * self.plan.timeout_s
        drivers, workers = fleet.alive(fleet.drivers), fleet.alive(fleet.workers)
        waits = {
            "driver_takeover_s": wait_until(
                "the surviving drivers' takeover",
                lambda: covers(driver_partitions(drivers), parts, each=False), fleet, budget),
            "worker_takeover_s": wait_until(
                "the surviving workers' takeover",
                lambda: covers(worker_partitions(workers), parts, each=False), fleet, budget)}
        timed = dict(zip(waits, await asyncio.gather(*waits.values()), strict=True))
        self.log(f"takeover: {timed}")
        return timed


async def _drive(settings: Settings, plan: ScaleOutPlan, fleet: Fleet, log: Log
                 ) -> tuple[Progress, Killing, float, dict[str, float]]:
    """Send the follow-ups and follow the topic until done; (progress, killing, elapsed s,
    takeover times)."""
    ids = [f"{settings.topic_prefix}s{n:05d}" for n in range(plan.sessions)]
    commands = followups(ids, plan.turns, turn_text)
    codec, inbox = InboxCodec(), settings.topics.inbox
    records = [OutRecord(inbox, c.session_id.encode(), codec.encode(c)) for c in commands]
    progress = Progress(Counter(dict.fromkeys(ids, plan.turns)), len(commands), ids)
    killing = Killing(fleet, plan, log, settings)
    step = max(1, len(commands) // 10)
    started = time.perf_counter()

    def on_turn_end(seen: Progress) -> None:
        if seen.turns_ended % step == 0:
            log(f"{seen.turns_ended}/{seen.turns_total} turns ended at "
                f"{time.perf_counter() - started:.1f} s")
        killing.maybe_kill(seen)

    for member in fleet.members:
        member.mark_cpu_start()
    await send_records(settings, records, timeout_s=120.0)
    await _follow_until_done(settings, progress, on_turn_end, fleet, plan)
    for member in fleet.members:
        member.mark_cpu_end()
    takeover = await killing.task if killing.task is not None else {}
    takeover["first_event_s"] = progress.first_event - started
    return progress, killing, progress.last_end - started, takeover


async def _follow_until_done(settings: Settings, progress: Progress,
                             on_turn_end: Callable[[Progress], None], fleet: Fleet,
                             plan: ScaleOutPlan) -> None:
    try:
        await asyncio.wait_for(follow(settings, progress, on_turn_end), plan.timeout_s)
    except TimeoutError:
        missing = sorted(progress.waiting)[:5]
        raise AssertionError(
            f"{len(progress.waiting)} sessions did not end their turns within "
            f"{plan.timeout_s:.0f} s (e.g. {missing}); ended {progress.turns_ended}/"
            f"{progress.turns_total}\n{fleet.tails()}") from None


async def run_scale_out(bootstrap: str, plan: ScaleOutPlan, workdir: Path, log: Log,
                        broker_pids: Sequence[int] = ()) -> dict[str, Any]:
    """One run (see the module doc); the figures and verification results as one dict."""
    settings = await run_settings(bootstrap, plan, workdir / "state")
    await ensure_topics(settings)
    fleet = Fleet(settings, plan, workdir)
    try:
        await start_fleet(fleet, log)
        brokers_cpu = [process_cpu_s(pid) or 0.0 for pid in broker_pids]
        load_before = load_average()
        progress, killing, elapsed, takeover = await _drive(settings, plan, fleet, log)
        brokers_used = sum((process_cpu_s(pid) or 0.0) - before
                           for pid, before in zip(broker_pids, brokers_cpu, strict=True))
        load_after = load_average()
        counters = fleet.stop_drivers()
        urls = [f"http://127.0.0.1:{m.port}" for m in fleet.alive(fleet.workers)]
        checks = await verify_run(settings, urls, log)
    finally:
        fleet.stop()
    return _figures(plan, progress, killing, elapsed, takeover, counters, fleet, checks,
                    brokers_used if broker_pids else None, f"{load_before} -> {load_after}")


def _figures(plan: ScaleOutPlan, progress: Progress, killing: Killing, elapsed: float,
             takeover: dict[str, float], counters: list[dict[str, Any]], fleet: Fleet,
             checks: dict[str, Any], brokers_cpu: float | None, load: str) -> dict[str, Any]:
    driver_cpu = sum(m.cpu_used for m in fleet.drivers)
    summed = Counter[str]()
    for snapshot in counters:
        summed.update({k: v for k, v in snapshot.items() if isinstance(v, int)})
    resumed = [ms - progress.kill_ms for p, ms in progress.resumed_ms.items()
               if p in killing.moved_partitions and progress.kill_ms is not None]
    return {
        "drivers": plan.drivers, "workers": plan.workers, "partitions": plan.partitions,
        "sessions": plan.sessions, "turns": progress.turns_ended, "steps": progress.steps,
        "events": progress.events, "elapsed_s": round(elapsed, 2),
        "steps_per_s": round(progress.steps / elapsed, 1),
        "events_per_s": round(progress.events / elapsed, 1),
        "driver_cpu_s": round(driver_cpu, 2),
        "steps_per_driver_cpu_s": round(progress.steps / max(driver_cpu, 1e-3), 1),
        "worker_cpu_s": round(sum(m.cpu_used for m in fleet.workers), 2),
        "broker_cpu_s": None if brokers_cpu is None else round(brokers_cpu, 2),
        "turn_end_kinds": dict(progress.end_kinds),
        # Crash repair closes what the dead driver left open, and also what a survivor was
        # running on a partition the rebalance moved to the other survivor.
        "interrupted_on_killed_drivers_partitions": sum(
            n for p, n in progress.interrupted.items() if p in killing.moved_partitions),
        "interrupted_elsewhere": sum(
            n for p, n in progress.interrupted.items() if p not in killing.moved_partitions),
        "killed": (None if killing.task is None else
                   f"{fleet.drivers[0].name} and {fleet.workers[0].name} (SIGKILL)"),
        "partitions_moved": len(killing.moved_partitions),
        "transactions": summed["transactions"],
        "events_per_transaction": round(progress.events / max(summed["transactions"], 1), 1),
        # Loaded by a survivor: busy at its takeover, or idle and then given a command.
        "sessions_moved": summed["sessions_rebuilt"] + summed["sessions_loaded"],
        "turns_after_kill": len(killing.late_sessions),
        "turns_repaired": summed["turns_repaired"],
        "session_failures": summed["session_failures"], "dead_letters": summed["dead_letters"],
        **{k: round(v, 1) for k, v in takeover.items()},
        "driver_resume_s": round(max(resumed) / 1000, 1) if resumed else None,
        **checks, "load_average": load,
    }
