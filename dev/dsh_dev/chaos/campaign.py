"""One chaos campaign: start the fleet, load it, fault it, let it settle, check, report.

Phases, each bounded in time:

1. **baseline**: load with no fault (``baseline_s``), for the no-fault throughput;
2. **faults**: the same load while :class:`~.faults.Faults` runs its plan (``fault_s``); the
   consumer lag is sampled every second and the session logs are checked every
   ``periodic_check_s`` (gaps, duplicates, invalid events: turns may be open then);
3. **settle**: load stops, every toxic is removed, provider faults are off, every service and
   node runs again, the shipped files are written whole; then the consumer groups must reach
   lag 0 and the sessions go idle;
4. **checks** (:mod:`.invariants`, the cost ledger's: :mod:`.ledger_check`) and the report
   (:mod:`.report`).

The processors price the usage with :func:`.ledger_check.chaos_prices`, whose one price
change falls :data:`PRICE_CHANGE_BASELINES` baseline phases after the services start (the
baseline begins once the processors are ready, so the change falls inside the load).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import aiohttp

from dsh_dev.chaos import invariants as inv
from dsh_dev.chaos.bounded import run_bounded
from dsh_dev.chaos.faults import FaultPlan, Faults
from dsh_dev.chaos.fleet import DEFAULT_STORE, Fleet, FleetOptions
from dsh_dev.chaos.ledger_check import (
    chaos_prices,
    check_ledger,
    ledger_on_topic,
    reference_ledger,
)
from dsh_dev.chaos.load import Load, ShipLoad, session_tenants
from dsh_dev.chaos.sender import Sender
from pipeline.adapters.kafka.topic_scan import last_seqs
from pipeline.codec.avro import EventSerde
from pipeline.core.errors import DshError
from pipeline.core.events import Event
from pipeline.core.prices import prices_from_text
from pipeline.services.processors.verify import wait_ready
from pipeline.services.replay.topic import TopicSessions, read_sessions
from pipeline.settings import Settings

Progress = Callable[[str], None]
READY_BUDGET_S: Final = 240.0
IDLE_BUDGET_S: Final = 240.0
SHIP_FILES: Final = 12
READ_BUDGET_S: Final = 300.0
PRICE_CHANGE_BASELINES: Final = 2


@dataclass(frozen=True, slots=True)
class CampaignOptions:
    seed: int
    sessions: int
    baseline_s: float
    fault_s: float
    workdir: Path
    rate_per_s: float = 4.0
    store: str = DEFAULT_STORE
    toxiproxy: Path | None = None
    periodic_check_s: float = 120.0


@dataclass(slots=True)
class Phase:
    name: str
    began_ms: int = 0
    ended_ms: int = 0


@dataclass(slots=True)
class Outcome:
    """Everything the report needs."""

    options: CampaignOptions
    phases: list[Phase] = field(default_factory=list)
    faults: Faults | None = None
    # (monotonic, wall ms, largest lag in seconds, lagging records), every second
    lag_samples: list[tuple[float, int, float, int]] = field(default_factory=list)
    periodic: list[inv.Result] = field(default_factory=list)
    results: list[inv.Result] = field(default_factory=list)
    lag_zero_s: float | None = None
    lag_groups: set[str] = field(default_factory=set)  # every group a lag sample named
    commands: int = 0
    unacknowledged: int = 0
    found: TopicSessions | None = None
    session_ids: list[str] = field(default_factory=list)
    provider_served: dict[str, int] = field(default_factory=dict)
    price_change_ms: int | None = None  # when the price table's one change applies
    tenants: dict[str, str] = field(default_factory=dict)  # session -> its tenant
    exits: list[str] = field(default_factory=list)  # services that exited on their own

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results + self.periodic)


class Campaign:
    def __init__(self, options: CampaignOptions, settings: Settings, progress: Progress) -> None:
        self.options = options
        self.progress = progress
        self.fleet = Fleet(FleetOptions(options.workdir, options.seed, store=options.store,
                                        toxiproxy=options.toxiproxy, prices=self._prices),
                           settings)
        self.outcome = Outcome(options)
        self.session_ids = [f"chaos-{options.seed}-{n:04d}" for n in range(options.sessions)]
        self.outcome.session_ids = self.session_ids
        self.outcome.tenants = session_tenants(self.session_ids)

    def _prices(self, start_ms: int) -> str:
        """The fleet's ``DSH_PRICES``, given the moment its services start."""
        change = start_ms + int(PRICE_CHANGE_BASELINES * self.options.baseline_s * 1000)
        self.outcome.price_change_ms = change
        return chaos_prices(change)

    def run(self) -> Outcome:
        """The whole campaign; the fleet is stopped whatever happens (Ctrl-C included)."""
        try:
            self.fleet.start(self.progress)
            asyncio.run(self._run())
        finally:
            self.progress("stopping the fleet ...")
            self.fleet.stop()
        return self.outcome

    async def _run(self) -> None:
        direct = self.fleet.direct
        assert direct is not None
        await self._wait_ready()
        sender = Sender(direct)
        await sender.start()
        try:
            load = Load(direct, self.session_ids, self.options.seed,
                        tenants=self.outcome.tenants)
            ship = ShipLoad(self.fleet.ship_dir, self.options.seed)
            ship.plan(SHIP_FILES)
            faults = Faults(self.fleet, sender, self.options.seed, self.progress)
            self.outcome.faults = faults
            await self._loaded(load, ship, faults)
            await self._settle(ship)
            self.outcome.commands = len(load.sent)
            self.outcome.unacknowledged = len(load.failed)
            await self._check(load, ship, faults)
        finally:
            await sender.stop()

    async def _wait_ready(self) -> None:
        for service in self.fleet.services.values():
            if service.kind == "processors":
                await wait_ready(f"http://127.0.0.1:{service.port}", timeout_s=READY_BUDGET_S)
        self.progress("processors workers ready")

    async def _loaded(self, load: Load, ship: ShipLoad, faults: Faults) -> None:
        """The baseline phase, then the fault phase, under one continuous load."""
        stop = asyncio.Event()
        background = [asyncio.create_task(load.run(faults.sender, stop,
                                                   self.options.rate_per_s)),
                      asyncio.create_task(ship.run(stop, 2.0)),
                      asyncio.create_task(self._sample_lag(stop)),
                      asyncio.create_task(self._supervise(stop))]
        try:
            baseline = self._phase("baseline")
            self.progress(f"baseline: {self.options.baseline_s:.0f} s of load, no faults")
            await asyncio.sleep(self.options.baseline_s)
            baseline.ended_ms = _now_ms()
            plan = FaultPlan.for_duration(self.options.fault_s)
            self.progress(f"faults: {self.options.fault_s:.0f} s, plan {plan}")
            phase = self._phase("faults")
            background.append(asyncio.create_task(self._periodic_checks(stop)))
            await faults.run(plan)
            phase.ended_ms = _now_ms()
        finally:
            stop.set()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError, DshError):
                    await asyncio.wait_for(task, 120)

    def _phase(self, name: str) -> Phase:
        phase = Phase(name, _now_ms())
        self.outcome.phases.append(phase)
        return phase

    async def _supervise(self, stop: asyncio.Event) -> None:
        """Restart what exits on its own (every second), and remember it: a finding."""
        while not stop.is_set():
            for line in self.fleet.revive():
                self.outcome.exits.append(f"{time.strftime('%H:%M:%S')} {line}")
                self.progress(f"supervisor: {line}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def _sample_lag(self, stop: asyncio.Event) -> None:
        """Every second: the largest lag (seconds) and the lagging records of all groups."""
        direct = self.fleet.direct
        assert direct is not None
        while not stop.is_set():
            samples, _ = await inv.lag_once(direct)
            self.outcome.lag_groups.update(s.group for s in samples)
            if samples:
                self.outcome.lag_samples.append(
                    (time.monotonic(), _now_ms(), max(s.seconds for s in samples),
                     sum(s.records for s in samples)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def _periodic_checks(self, stop: asyncio.Event) -> None:
        direct = self.fleet.direct
        assert direct is not None
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.options.periodic_check_s)
                return
            try:
                found = await run_bounded(lambda: read_sessions(direct, EventSerde().decode),
                                          READ_BUDGET_S)
            except (DshError, TimeoutError) as exc:
                self.progress(f"periodic check skipped: {type(exc).__name__}: {exc}")
                continue
            result = inv.check_logs(found, self.session_ids, final=False)
            result.name = f"periodic check at {time.strftime('%H:%M:%S')}: {result.name}"
            self.outcome.periodic.append(result)
            self.progress(f"{result.name}: {'ok' if result.ok else 'VIOLATED'}")

    async def _settle(self, ship: ShipLoad) -> None:
        """Every fault off, every part running, files whole; then wait for lag 0 and idle."""
        fleet = self.fleet
        assert fleet.toxiproxy is not None and fleet.kafka is not None
        assert fleet.answers is not None
        fleet.toxiproxy.reset()
        fleet.answers.set_rates(rate_limit=0, server_error=0, stall=0, torn=0)
        for node in fleet.kafka.dead_nodes():
            fleet.kafka.restart(node.node_id)
        for service in fleet.services.values():
            fleet.resume(service)
        for line in fleet.revive():
            self.outcome.exits.append(f"{time.strftime('%H:%M:%S')} {line}")
        ship.finish()
        settled = time.monotonic()
        self.progress("settling: load stopped, faults off; waiting for lag 0 ...")
        direct = fleet.direct
        assert direct is not None
        result, took = await inv.wait_lag_zero(direct, groups=self.outcome.lag_groups)
        shipped = await self._wait_shipped(ship, IDLE_BUDGET_S)
        self.progress(f"shipped files whole on the topic: {shipped}")
        self.outcome.lag_zero_s = took
        self.outcome.results.append(result)
        self.progress(f"lag: {result.summary}; waiting for every session to be idle ...")
        idle = await self._wait_idle(IDLE_BUDGET_S - (time.monotonic() - settled) + 60)
        self.progress(f"sessions idle: {idle}")

    async def _wait_shipped(self, ship: ShipLoad, budget_s: float) -> bool:
        """Until the topic holds the last seq of every whole shipped file (bounded): the
        shipper, restarted by the supervisor after a fault, may still be catching up."""
        direct = self.fleet.direct
        assert direct is not None
        wanted = {sid: len(events) - 1 for sid, events in ship.files.items()}
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            with contextlib.suppress(DshError, TimeoutError):
                found = await asyncio.wait_for(
                    last_seqs(direct, direct.topics.session_events), 60)
                if all(found.get(sid, -1) >= last for sid, last in wanted.items()):
                    return True
            await asyncio.sleep(2.0)
        return False

    async def _wait_idle(self, budget_s: float) -> bool:
        """Until the dashboard shows every campaign session, none in a turn (bounded)."""
        wanted = set(self.session_ids)
        url = f"http://127.0.0.1:{self.fleet.services['dashboard'].port}/api/fleet"
        deadline = time.monotonic() + max(budget_s, 30.0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    async with http.get(url) as answer:
                        rows = (await answer.json())["sessions"]
                    ours = [r for r in rows if r["session_id"] in wanted]
                    if len(ours) == len(wanted) and all(r["state"] == "idle" for r in ours):
                        return True
                await asyncio.sleep(2.0)
        return False

    async def _check(self, load: Load, ship: ShipLoad, faults: Faults) -> None:
        direct = self.fleet.direct
        assert direct is not None and self.fleet.answers is not None
        self.progress("checking the invariants ...")
        found = await run_bounded(lambda: read_sessions(direct, EventSerde().decode),
                                  READ_BUDGET_S)
        self.outcome.found = found
        results = self.outcome.results
        results.append(inv.check_commands(found, load.sent))
        logs_result = inv.check_logs(found, self.session_ids, final=True)
        results.append(logs_result)
        results.append(inv.check_zombies(faults.log, logs_result))
        results.append(inv.check_repairs(found, self.session_ids))
        results.append(inv.check_shipped(found, ship.files))
        logs: dict[str, list[Event]] = {s: inv.events_of(found, s)
                                        for s in [*self.session_ids, *ship.files]}
        urls = [f"http://127.0.0.1:{s.port}" for s in self.fleet.services.values()
                if s.kind == "processors"]
        results.append(await inv.check_processors(urls, logs, timeout_s=180,
                                                  evidence=self.options.workdir / "evidence"))
        results.append(await run_bounded(
            lambda: inv.check_dead_letters(direct, faults.garbage), READ_BUDGET_S))
        dashboard = f"http://127.0.0.1:{self.fleet.services['dashboard'].port}"
        results.append(await inv.check_dashboard(dashboard, found, self.session_ids, 60))
        results.append(await self._check_ledger(found))
        self.outcome.provider_served = dict(self.fleet.answers.served)

    async def _check_ledger(self, found: TopicSessions) -> inv.Result:
        """The usage topic's ledger against the logs' and the provider's usage."""
        direct, provider = self.fleet.direct, self.fleet.provider
        assert direct is not None and provider is not None
        logs = {session_id: inv.events_of(found, session_id) for session_id in found.events}
        reference = reference_ledger(logs, prices_from_text(direct.prices))
        rows, error = await ledger_on_topic(direct, reference.rows)
        driven = {session_id: logs.get(session_id, []) for session_id in self.session_ids}
        return check_ledger(reference, rows, driven, list(provider.server.reported),
                            price_change_ms=self.outcome.price_change_ms, read_error=error)


def _now_ms() -> int:
    return int(time.time() * 1000)


def derive_seed(seed: int | None) -> int:
    return seed if seed is not None else random.SystemRandom().randrange(1, 1_000_000)
