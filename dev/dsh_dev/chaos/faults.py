"""The faults: drawn by seed, spread over the fault phase, each logged with wall-clock times.

One loop per family, each bounded by a count and by the phase's deadline:

- ``kill-driver`` / ``kill-processors``: ``kill -9`` of one of two (never the last one alive),
  restarted after a random pause; a driver kill also measures the survivor's takeover (until
  its ``/health`` lists every partition and none is still building);
- ``kill-broker``: ``kill -9`` of one node (never two at once), restarted after a pause;
- ``stop-driver``: ``SIGSTOP`` of a driver for longer than its group session timeout, then
  ``SIGCONT``: the zombie must be fenced (its lines mentioning fencing are counted);
- ``stop-processors``: the same for a processors worker, which folds no transactions: the
  zombie resumes with fetched batches and table writes in flight, and writes to changelog
  partitions that another worker owns by then (a changelog with two writers; drawn from a
  random stream of its own, so that the other families draw as before);
- ``net-<toxic>``: a Toxiproxy toxic on one broker's proxy for a few seconds (latency with
  jitter, timeout, reset_peer, bandwidth), in turn;
- ``provider-<kind>``: the provider answers with that fault at a high rate for a while
  (429 with Retry-After, 5xx, a stalled stream, a torn stream), in turn;
- ``garbage-<kind>``: records written straight into the inbox or the session topic (random
  bytes, a Confluent frame with an unknown schema id, truncated Avro), in turn.
"""

from __future__ import annotations

import asyncio
import os
import random
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from dsh_dev.chaos.answers import FAULT_KINDS
from dsh_dev.chaos.cluster import ProxiedKafka
from dsh_dev.chaos.fleet import (
    DRIVER_SESSION_TIMEOUT_MS,
    PROCESSORS_SESSION_TIMEOUT_S,
    Fleet,
    Service,
)
from dsh_dev.chaos.sender import Sender
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.core.errors import DshError
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp

TOXICS: Final[dict[str, dict[str, int]]] = {
    "latency": {"latency": 400, "jitter": 300},
    "timeout": {"timeout": 3000},
    "reset_peer": {"timeout": 200},
    "bandwidth": {"rate": 32},
}
GARBAGE: Final = ("random-bytes", "unknown-schema-id", "truncated-avro")
TAKEOVER_BUDGET_S: Final = 90.0
WAIT_BUDGET_S: Final = 30.0  # a fault waits this long for its precondition, then is skipped


@dataclass(slots=True)
class FaultRecord:
    kind: str
    target: str
    began_wall: float
    began: float  # monotonic
    ended: float = 0.0  # monotonic: the fault is over (restarted, resumed, removed)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GarbageRecord:
    topic: str
    partition: int
    offset: int
    kind: str


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """How many faults of each family, over ``seconds`` of fault phase."""

    seconds: float
    service_kills: int
    broker_kills: int
    stops: int
    toxics: int
    provider_windows: int
    garbage: int
    processors_stops: int = 0

    @classmethod
    def for_duration(cls, seconds: float) -> FaultPlan:
        return cls(seconds, service_kills=max(4, round(seconds / 6)),
                   broker_kills=max(1, round(seconds / 65)), stops=max(1, round(seconds / 150)),
                   toxics=max(4, round(seconds / 15)),
                   provider_windows=max(len(FAULT_KINDS), round(seconds / 30)),
                   garbage=max(2 * len(GARBAGE), round(seconds / 20)),
                   processors_stops=max(1, round(seconds / 100)))


class Faults:
    """Runs the plan against the fleet; ``log`` and ``garbage`` say what happened."""

    def __init__(self, fleet: Fleet, sender: Sender, seed: int, progress: Callable[[str], None]
                 ) -> None:
        self.fleet = fleet
        self.sender = sender
        self.rng = random.Random(seed ^ 0x5EED)
        self.stop_rng = random.Random(seed ^ 0x5709)   # stop-processors' own draws
        self.progress = progress
        self.log: list[FaultRecord] = []
        self.garbage: list[GarbageRecord] = []
        self.takeovers: list[float] = []
        self.errors: list[str] = []
        self._measuring: set[asyncio.Task[None]] = set()

    async def run(self, plan: FaultPlan) -> None:
        deadline = time.monotonic() + plan.seconds
        families: list[tuple[int, Callable[[int], Awaitable[None]]]] = [
            (plan.service_kills, self._kill_service), (plan.broker_kills, self._kill_broker),
            (plan.stops, self._stop_driver), (plan.toxics, self._toxic),
            (plan.provider_windows, self._provider_window), (plan.garbage, self._garbage)]
        await asyncio.gather(*(self._paced(count, action, plan.seconds, deadline)
                               for count, action in families),
                             self._paced(plan.processors_stops, self._stop_processors,
                                         plan.seconds, deadline, self.stop_rng))
        if self._measuring:
            await asyncio.wait(self._measuring, timeout=TAKEOVER_BUDGET_S)

    async def _paced(self, count: int, action: Callable[[int], Awaitable[None]],
                     seconds: float, deadline: float, rng: random.Random | None = None
                     ) -> None:
        """``count`` faults, one per slot of ``seconds / count``, at a random point of it."""
        if count < 1:
            return
        slot, rng = seconds / count, rng or self.rng
        began = time.monotonic()
        for n in range(count):
            at = began + slot * n + rng.uniform(0.05, 0.6) * slot
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if time.monotonic() >= deadline:
                return
            try:
                await action(n)
            except (DshError, OSError, aiohttp.ClientError, TimeoutError) as exc:
                self.errors.append(f"{action.__name__} #{n}: {type(exc).__name__}: {exc}")

    def _record(self, kind: str, target: str, **detail: Any) -> FaultRecord:
        record = FaultRecord(kind, target, time.time(), time.monotonic(), detail=detail)
        self.log.append(record)
        self.progress(f"fault {len(self.log)}: {kind} {target} {detail or ''}".rstrip())
        return record

    # -- processes ------------------------------------------------------------------------

    async def _kill_service(self, n: int) -> None:
        kind = "driver" if n % 2 == 0 else "processors"
        pair = [s for s in self.fleet.services.values() if s.kind == kind]
        # Never the last one running: wait until the other one is back (it may be restarting).
        if not await _until(lambda: all(s.alive() and not s.stopped for s in pair)):
            return
        victim = self.rng.choice(pair)
        pause = self.rng.uniform(0.5, 6.0)
        record = self._record(f"kill-{kind}", victim.name, pause_s=round(pause, 2))
        victim.held = True
        self.fleet.kill9(victim)
        if kind == "driver":
            task = asyncio.create_task(self._takeover(pair, record))
            self._measuring.add(task)
            task.add_done_callback(self._measuring.discard)
        await asyncio.sleep(pause)
        self.fleet.launch(victim)
        victim.held = False
        record.ended = time.monotonic()

    async def _takeover(self, drivers: list[Service], record: FaultRecord) -> None:
        seconds = await self._takeover_s(drivers)
        if seconds is not None:
            self.takeovers.append(seconds)
            record.detail["takeover_s"] = round(seconds, 2)

    async def _takeover_s(self, drivers: list[Service]) -> float | None:
        """Seconds from a kill until the drivers (the survivor, or the restarted victim too)
        own every partition again with none still building (None: not within budget)."""
        began = time.monotonic()
        partitions = self.fleet.options.partitions
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            await asyncio.sleep(0.5)
            while time.monotonic() - began < TAKEOVER_BUDGET_S:
                owned: set[int] = set()
                building = False
                for driver in drivers:
                    body = await _health(http, f"http://127.0.0.1:{driver.port}/health")
                    owned.update(body.get("partitions", []))
                    building = building or bool(body.get("building"))
                if len(owned) == partitions and not building:
                    return time.monotonic() - began
                await asyncio.sleep(0.2)
        return None

    async def _kill_broker(self, n: int) -> None:
        kafka = self.fleet.kafka
        assert kafka is not None
        if not await _until(lambda: not kafka.dead_nodes()):
            return
        node = self.rng.choice([1, 2, 3])
        pause = self.rng.uniform(2.0, 12.0)
        record = self._record("kill-broker", f"node-{node}", pause_s=round(pause, 2))
        kafka.kill9(node)
        await asyncio.sleep(pause)
        kafka.restart(node)
        record.ended = time.monotonic()

    async def _stop_driver(self, n: int) -> None:
        stopped = await self._stop("driver", DRIVER_SESSION_TIMEOUT_MS / 1000, self.rng)
        if stopped is not None:
            victim, record, size = stopped
            await asyncio.sleep(5.0)
            record.detail["fenced_lines"] = _count_after(victim.log_path, size,
                                                         ("fenced", "Fenced", "revoked"))

    async def _stop_processors(self, n: int) -> None:
        await self._stop("processors", PROCESSORS_SESSION_TIMEOUT_S, self.stop_rng)

    async def _stop(self, kind: str, timeout_s: float, rng: random.Random
                    ) -> tuple[Service, FaultRecord, int] | None:
        """``SIGSTOP`` one of the two services of ``kind`` (both running) for its group
        session timeout ``timeout_s`` + 3-8 s, then ``SIGCONT``; the victim, its record and
        its log's size when it stopped."""
        pair = [s for s in self.fleet.services.values() if s.kind == kind]
        if not await _until(lambda: all(s.alive() and not s.stopped for s in pair)):
            return None
        victim = rng.choice(pair)
        seconds = timeout_s + rng.uniform(3.0, 8.0)
        size = victim.log_path.stat().st_size if victim.log_path.exists() else 0
        record = self._record(f"stop-{kind}", victim.name, stopped_s=round(seconds, 2))
        self.fleet.pause(victim)
        await asyncio.sleep(seconds)
        self.fleet.resume(victim)
        record.ended = time.monotonic()
        return victim, record, size

    # -- network, provider, garbage -------------------------------------------------------

    async def _toxic(self, n: int) -> None:
        toxiproxy, kafka = self.fleet.toxiproxy, self.fleet.kafka
        assert toxiproxy is not None and kafka is not None
        kind = list(TOXICS)[n % len(TOXICS)]
        node = self.rng.choice([1, 2, 3])
        seconds = self.rng.uniform(2.0, 8.0)
        proxy, name = ProxiedKafka.proxy_name(node), f"chaos-{n}"
        stream = self.rng.choice(("downstream", "upstream"))
        record = self._record(f"net-{kind}", proxy, stream=stream, seconds=round(seconds, 2))
        toxiproxy.add_toxic(proxy, name, kind, TOXICS[kind], stream=stream)
        try:
            await asyncio.sleep(seconds)
        finally:
            toxiproxy.remove_toxic(proxy, name)
            record.ended = time.monotonic()

    async def _provider_window(self, n: int) -> None:
        answers = self.fleet.answers
        assert answers is not None
        kind = FAULT_KINDS[n % len(FAULT_KINDS)]
        seconds = self.rng.uniform(4.0, 12.0)
        before = answers.served[kind]
        record = self._record(f"provider-{kind}", "provider", seconds=round(seconds, 2))
        answers.set_rates(**{kind: 0.35})
        try:
            await asyncio.sleep(seconds)
        finally:
            answers.set_rates(**{kind: 0.0})
            record.ended = time.monotonic()
            record.detail["served"] = answers.served[kind] - before

    async def _garbage(self, n: int) -> None:
        kind = GARBAGE[n % len(GARBAGE)]
        settings = self.fleet.direct
        assert settings is not None
        inbox = n % 2 == 0
        topic = settings.topics.inbox if inbox else settings.topics.session_events
        key = f"garbage-{n:04d}"
        value = _garbage_value(kind, key, inbox, self.rng)
        record = self._record(f"garbage-{kind}", topic, key=key)
        partition, offset = await self.sender.send(topic, key.encode(), value)
        record.ended = time.monotonic()
        record.detail.update(partition=partition, offset=offset)
        self.garbage.append(GarbageRecord(topic, partition, offset, kind))


async def _until(condition: Callable[[], bool], budget_s: float = WAIT_BUDGET_S) -> bool:
    """Wait (bounded) until ``condition()`` holds; False if it never did."""
    deadline = time.monotonic() + budget_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.25)
    return True


async def _health(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """A driver's /health body, {} when it does not answer."""
    try:
        async with http.get(url) as answer:
            body = await answer.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _garbage_value(kind: str, key: str, inbox: bool, rng: random.Random) -> bytes:
    if kind == "random-bytes":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300)))
    if kind == "unknown-schema-id":
        body = bytes(rng.getrandbits(8) for _ in range(rng.randint(10, 100)))
        return b"\x00" + struct.pack(">I", 0x7FFF0000 + rng.randint(0, 0xFFFF)) + body
    if inbox:
        valid = InboxCodec().encode(FollowUp(session_id=key, message_id=f"{key}-m",
                                             content=({"type": "text", "text": "x" * 40},)))
    else:
        valid = EventSerde().encode(key, Event(type="turn/start", seq=0, time=0,
                                               data={"turn": 1}))
    return valid[: max(11, len(valid) // 2)]


def _count_after(path: os.PathLike[str], offset: int, words: tuple[str, ...]) -> int:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return 0
    return sum(1 for line in text.splitlines() if any(w in line for w in words))
