"""The processes of the scale-out run (:mod:`scale_out_support`): the local 3-node cluster,
the ``dsh-pipeline driver`` and ``dsh-pipeline processors`` children (localstack
:class:`ChildProcess`, each in its own process group), their ``/health`` and CPU time, and
waiting until the driver group and the workers own every partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsh_dev.cli.demo_fleet import start_processors
from dsh_dev.localstack.artifacts import Artifacts
from dsh_dev.localstack.kafka import KafkaLocal
from dsh_dev.localstack.process import ChildProcess, free_ports
from pipeline.settings import Settings

Log = Callable[[str], None]
CLUSTER_READY_S = 300.0
START_BUDGET_S = 240.0  # eight Python processes importing faust/aiokafka on 2 busy cores
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ScaleOutPlan:
    """The shape of one run. ``kill_at``: fraction of all turns ended when driver 1 and
    worker 1 get SIGKILL (None: nothing is killed). ``turns_after_kill``: sessions of the
    killed driver's partitions that get one more turn, sent right after the kill, so the
    survivors must load them from their checkpoints whatever the kill found in flight."""

    drivers: int = 3
    workers: int = 2
    sessions: int = 36
    turns: int = 1
    partitions: int = 12
    kill_at: float | None = 0.3
    turns_after_kill: int = 0
    driver_session_timeout_ms: int = 10_000
    worker_session_timeout_s: float = 10.0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.kill_at is not None and (self.drivers < 2 or self.workers < 2):
            raise ValueError("a run that kills a driver and a worker needs 2 or more of each")


@contextlib.contextmanager
def local_cluster(log: Log, heap_mb: int = 384) -> Iterator[KafkaLocal]:
    """The local 3-node KRaft cluster (replication 3, min ISR 2), stopped afterwards."""
    kafka = KafkaLocal(Artifacts.default().require_kafka(), nodes=3, heap_mb=heap_mb)
    began = time.monotonic()
    try:
        kafka.start(budget_s=CLUSTER_READY_S)
        log(f"3-node cluster ready in {time.monotonic() - began:.0f} s at {kafka.bootstrap}")
        yield kafka
    finally:
        kafka.stop()


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a running process (Linux ``/proc``), None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name may hold spaces; fields follow ")"
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


# -- the child processes -----------------------------------------------------------------


@dataclass(slots=True)
class Member:
    """One driver or worker process, with the HTTP port of its ``/health``."""

    name: str
    process: ChildProcess
    port: int
    cpu_start: float = 0.0
    cpu_end: float | None = None
    killed_at: float | None = None

    def health(self) -> dict[str, Any] | None:
        """The ``/health`` body, or None while it does not answer."""
        url = f"http://127.0.0.1:{self.port}/health"
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"null")
        except (OSError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    def cpu_now(self) -> float:
        return process_cpu_s(self.process.pid) or self.cpu_start

    def mark_cpu_start(self) -> None:
        self.cpu_start = self.cpu_now()

    def mark_cpu_end(self) -> None:
        if self.cpu_end is None:
            self.cpu_end = self.cpu_now()

    @property
    def cpu_used(self) -> float:
        return (self.cpu_end if self.cpu_end is not None else self.cpu_now()) - self.cpu_start

    def kill9(self) -> None:
        self.mark_cpu_end()
        self.killed_at = time.time()
        self.process.kill9()

    def tail(self) -> str:
        return f"--- {self.name} ({self.process.log_path}):\n{self.process.log_tail(25)}"


class Fleet:
    """The drivers and workers of one run, started together, stopped together."""

    def __init__(self, settings: Settings, plan: ScaleOutPlan, workdir: Path) -> None:
        self.settings, self.plan, self.workdir = settings, plan, workdir
        self.drivers: list[Member] = []
        self.workers: list[Member] = []

    def launch(self) -> None:
        ports = free_ports(self.plan.drivers + self.plan.workers)
        for n in range(self.plan.workers):
            port = ports.pop()
            # INFO: the rebalances, recoveries and dropped batches, to read when a run fails
            extra = ["--session-timeout", str(self.plan.worker_session_timeout_s),
                     "--loglevel", "INFO"]
            process = start_processors(self.settings, port, self.workdir / f"worker-{n + 1}.log",
                                       extra=extra, name=f"worker {n + 1}")
            self.workers.append(Member(f"worker {n + 1}", process, port))
        for n in range(self.plan.drivers):
            self.drivers.append(self._start_driver(n + 1, ports.pop()))

    def _start_driver(self, number: int, port: int) -> Member:
        argv = [sys.executable, "-m", "pipeline.cli.main", "driver", "--script", "tool-loop",
                "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
                "--session-timeout-ms", str(self.plan.driver_session_timeout_ms),
                "--grace", "5"]
        process = ChildProcess(f"driver {number}", argv, self.workdir / f"driver-{number}.log",
                               Path.cwd(), env={**os.environ, **self.settings.to_env()})
        return Member(f"driver {number}", process, port)

    @property
    def members(self) -> list[Member]:
        return [*self.drivers, *self.workers]

    def alive(self, members: Sequence[Member]) -> list[Member]:
        return [m for m in members if m.killed_at is None]

    def exited(self) -> list[Member]:
        """Members that died without being killed by the run (a crash: the run fails)."""
        return [m for m in self.members if m.killed_at is None and not m.process.alive()]

    def tails(self) -> str:
        return "\n".join(m.tail() for m in self.members)

    def stop_drivers(self) -> list[dict[str, Any]]:
        """SIGTERM every live driver, wait, and return the counters each one printed."""
        live = self.alive(self.drivers)
        for member in live:
            member.process.terminate()
        for member in live:
            member.process.wait_stopped(30.0)
        return [_final_counters(m) for m in live]

    def stop(self) -> None:
        for member in self.members:
            member.process.terminate()
        for member in self.members:
            member.process.wait_stopped(30.0)


def _final_counters(member: Member) -> dict[str, Any]:
    """The ``{"stopped": true, ...}`` line a driver prints on a graceful stop."""
    text = member.process.log_path.read_text(encoding="utf-8", errors="replace")
    for line in reversed(text.splitlines()):
        if line.startswith('{"stopped"'):
            return dict(json.loads(line))
    raise AssertionError(f"{member.name} printed no final counters\n{member.tail()}")


# -- waiting for the fleet ---------------------------------------------------------------


def driver_partitions(members: Sequence[Member]) -> list[list[int]] | None:
    """Each live driver's built partitions, or None while one is not ready or building."""
    owned: list[list[int]] = []
    for member in members:
        body = member.health()
        if body is None or not body.get("ready") or body.get("building"):
            return None
        owned.append(list(body.get("partitions", [])))
    return owned


def worker_partitions(members: Sequence[Member]) -> list[list[int]] | None:
    """Each live worker's active partitions, or None while one is down or recovering."""
    owned: list[list[int]] = []
    for member in members:
        body = member.health()
        if body is None or body.get("recovery", {}).get("in_recovery", True):
            return None
        owned.append(list(body.get("partitions", [])))
    return owned


def covers(owned: list[list[int]] | None, partitions: int, *, each: bool = True) -> bool:
    """Every partition owned exactly once (and, with ``each``, every member owning some)."""
    if owned is None:
        return False
    flat = sorted(p for parts in owned for p in parts)
    return flat == list(range(partitions)) and (not each or all(owned))


async def wait_until(what: str, check: Callable[[], bool], fleet: Fleet,
                     timeout_s: float) -> float:
    """Poll ``check`` (in a thread: it does HTTP) until true; seconds waited. Raises with
    every member's log tail on timeout or when a member died on its own."""
    began = time.monotonic()
    while not await asyncio.to_thread(check):
        crashed = fleet.exited()
        if crashed or time.monotonic() - began > timeout_s:
            why = f"{crashed[0].name} exited" if crashed else f"not within {timeout_s:.0f} s"
            raise AssertionError(f"waiting for {what}: {why}\n{fleet.tails()}")
        await asyncio.sleep(0.25)
    return time.monotonic() - began


async def start_fleet(fleet: Fleet, log: Log) -> None:
    fleet.launch()
    parts = fleet.plan.partitions
    waited = await wait_until(
        "the drivers' assignment", lambda: covers(driver_partitions(fleet.drivers), parts),
        fleet, START_BUDGET_S)
    log(f"{len(fleet.drivers)} drivers ready in {waited:.0f} s: "
        f"{driver_partitions(fleet.drivers)}")
    waited += await wait_until(
        "the workers' assignment", lambda: covers(worker_partitions(fleet.workers), parts),
        fleet, START_BUDGET_S)
    log(f"{len(fleet.workers)} workers ready after {waited:.0f} s: "
        f"{worker_partitions(fleet.workers)}")
