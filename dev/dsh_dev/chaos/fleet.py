"""The chaos campaign's fleet: cluster, proxies, provider and every service as a subprocess.

Started in this order: Toxiproxy; the 3-node cluster behind it (:class:`ProxiedKafka`); the
project's topics (replication 3); the provider server (a thread of this process, its own
event loop); then 2 processors workers, 2 drivers, the dashboard and a shipper, each a
``dsh-pipeline`` subprocess whose ``DSH_*`` settings point at the proxies (and whose
``DSH_PRICES`` is :attr:`FleetOptions.prices` of the moment the services start). :meth:`Fleet.stop`
stops everything that was started, whatever state it is in (also after a failed start).

Children run in their own process groups with ``PR_SET_PDEATHSIG`` (see
:mod:`dsh_dev.localstack.process`), so they die with this process even when it is
killed; start and restart them from the main thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from dsh_dev.chaos.answers import GeneratedAnswers
from dsh_dev.chaos.cluster import ProxiedKafka
from dsh_dev.chaos.provider_server import LLMTestServer
from dsh_dev.chaos.toxiproxy import Toxiproxy
from dsh_dev.localstack.artifacts import Artifacts, ensure_artifacts
from dsh_dev.localstack.process import ChildProcess, free_ports
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.settings import Settings

PriceTableAt = Callable[[int], str]
"""The ``DSH_PRICES`` of the fleet, given the moment (epoch ms) its services start."""

DRIVER_SESSION_TIMEOUT_MS: Final = 6_000
PROCESSORS_SESSION_TIMEOUT_S: Final = 6.0
CHILD_STOP_S: Final = 20.0

Progress = Callable[[str], None]


@dataclass(slots=True)
class Service:
    """One ``dsh-pipeline`` subprocess the campaign may kill and restart."""

    name: str
    kind: str  # driver | processors | dashboard | shipper
    argv: list[str]
    log_path: Path
    port: int = 0
    process: ChildProcess | None = None
    stopped: bool = False  # SIGSTOPped
    held: bool = False  # killed by a fault, to be restarted by it (not by the supervisor)
    starts: int = 0

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()


# The processors' store of the shipped configuration (compose, Kubernetes).
DEFAULT_STORE: Final = "rocksdb://"

@dataclass(slots=True)
class FleetOptions:
    workdir: Path
    seed: int
    store: str = DEFAULT_STORE
    toxiproxy: Path | None = None
    partitions: int = 6
    stall_s: float = 8.0
    prices: PriceTableAt | None = None


@dataclass(slots=True)
class Fleet:
    options: FleetOptions
    base: Settings
    toxiproxy: Toxiproxy | None = None
    kafka: ProxiedKafka | None = None
    answers: GeneratedAnswers | None = None
    provider: ProviderThread | None = None
    services: dict[str, Service] = field(default_factory=dict)
    ship_dir: Path = Path()
    settings: Settings | None = None  # the services' (through the proxies)
    direct: Settings | None = None  # the campaign's own (straight to the brokers)

    def start(self, progress: Progress) -> None:
        work = self.options.workdir
        self.toxiproxy = Toxiproxy(work, self.options.toxiproxy)
        self.toxiproxy.start()
        artifacts = Artifacts.default()
        ensure_artifacts(artifacts, progress=progress)
        self.kafka = ProxiedKafka(artifacts.require_kafka(), work / "kafka", self.toxiproxy)
        progress("starting the 3-node cluster behind Toxiproxy ...")
        self.kafka.start(budget_s=120)
        self.direct = replace(self.base, bootstrap_servers=self.kafka.bootstrap,
                              replication_factor=3, partitions=self.options.partitions,
                              state_dir=str(work / "state"), provider="openai",
                              model="chaos-model-a")
        asyncio.run(ensure_topics(self.direct))
        self.answers = GeneratedAnswers(self.options.seed, stall_s=self.options.stall_s)
        self.provider = ProviderThread(self.answers)
        base_url = self.provider.start()
        if self.options.prices is not None:
            self.direct = replace(self.direct,
                                  prices=self.options.prices(int(time.time() * 1000)))
        self.settings = replace(self.direct, bootstrap_servers=self.kafka.proxied_bootstrap,
                                provider_base_url=base_url)
        self.ship_dir = work / "ship"
        self.ship_dir.mkdir(parents=True, exist_ok=True)
        self._plan_services()
        for service in self.services.values():
            self.launch(service)
        progress(f"fleet started: {', '.join(self.services)}; provider at {base_url}")

    def _plan_services(self) -> None:
        ports = iter(free_ports(6))
        cli = [sys.executable, "-m", "pipeline.cli.main"]
        for n in (1, 2):
            port = next(ports)
            self._add(Service(f"processors-{n}", "processors", [
                *cli, "processors", "--web-port", str(port), "--store", self.options.store,
                "--session-timeout", str(PROCESSORS_SESSION_TIMEOUT_S), "--loglevel", "warning",
                "--data-dir", str(self.options.workdir / "state" / f"processors-{n}")],
                self._log(f"processors-{n}"), port))
        for n in (1, 2):
            port = next(ports)
            self._add(Service(f"driver-{n}", "driver", [
                *cli, "driver", "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
                "--session-timeout-ms", str(DRIVER_SESSION_TIMEOUT_MS), "--grace", "2"],
                self._log(f"driver-{n}"), port))
        port = next(ports)
        self._add(Service("dashboard", "dashboard", [*cli, "dashboard", "--port", str(port)],
                          self._log("dashboard"), port))
        self._add(Service("shipper", "shipper", [
            *cli, "ship", str(self.ship_dir), "--follow", "--interval", "0.5"],
            self._log("shipper")))

    def _add(self, service: Service) -> None:
        self.services[service.name] = service

    def _log(self, name: str) -> Path:
        return self.options.workdir / "logs" / f"{name}.log"

    def launch(self, service: Service) -> None:
        assert self.settings is not None
        env = {**os.environ, **self.settings.to_env(), "DEEPSEEK_API_KEY": "chaos-local-key",
               "DSH_DASHBOARD_HOST": "127.0.0.1"}
        service.starts += 1
        service.stopped = False
        service.log_path.parent.mkdir(parents=True, exist_ok=True)
        with service.log_path.open("a") as log:
            log.write(f"\n=== chaos: start #{service.starts} of {service.name}\n")
        service.process = ChildProcess(service.name, service.argv, service.log_path,
                                       Path.cwd(), env=env)

    def revive(self) -> list[str]:
        """The supervisor's round: restart every service that exited on its own (as a
        process supervisor would); returns what exited, with its exit code and last line."""
        exits = []
        for service in self.services.values():
            process = service.process
            if process is None or process.alive() or service.held:
                continue
            last = _last_line(service.log_path)
            exits.append(f"{service.name} exited on its own (code {process.returncode}): "
                         f"{last}")
            self.launch(service)
        return exits

    def kill9(self, service: Service) -> None:
        if service.process is not None:
            service.process.kill9()
        service.stopped = False

    def pause(self, service: Service) -> None:
        if service.process is not None and service.process.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.process.pid, signal.SIGSTOP)
            service.stopped = True

    def resume(self, service: Service) -> None:
        if service.process is not None and service.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.process.pid, signal.SIGCONT)
        service.stopped = False

    def stop(self) -> None:
        """Stop every child started, in reverse order; never raises."""
        for service in self.services.values():
            with contextlib.suppress(Exception):
                self.resume(service)
                if service.process is not None:
                    service.process.terminate()
        for service in self.services.values():
            with contextlib.suppress(Exception):
                if service.process is not None:
                    service.process.wait_stopped(CHILD_STOP_S)
        for part in (self.provider, self.kafka, self.toxiproxy):
            with contextlib.suppress(Exception):
                if part is not None:
                    part.stop()


class ProviderThread:
    """The provider server on its own event loop in a daemon thread."""

    def __init__(self, answers: GeneratedAnswers) -> None:
        self.server = LLMTestServer(answers, keep_requests=False)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-provider",
                                        daemon=True)

    def start(self) -> str:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(30)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _last_line(path: Path) -> str:
    """The last non-empty line of a log (where a service says why it stopped)."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - 4096))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return "(no log)"
    return next((line.strip() for line in reversed(lines) if line.strip()), "(empty log)")[:300]
