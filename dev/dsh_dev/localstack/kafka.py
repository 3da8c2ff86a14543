"""A local Apache Kafka (KRaft) of one combined node, or a 3-node cluster, started with ``java``.

Single node: storage formatted with ``StorageTool format --standalone`` and a dynamic quorum
(``controller.quorum.bootstrap.servers``). Cluster: every node formatted with the same cluster
id and no quorum flag, all sharing a static ``controller.quorum.voters``; replication factor 3
and ``min.insync.replicas=2`` so one node can die without losing an acknowledged write.

Ready means an admin client's metadata request succeeds and lists every node, not merely an
open port. Usage::

    with KafkaLocal(artifacts.require_kafka(), workdir) as kafka:
        kafka.bootstrap   # "127.0.0.1:PORT"
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import shutil
import socket
import ssl
import string
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

from aiokafka.admin import AIOKafkaAdminClient

from dsh_dev.localstack.artifacts import DEPLOY_DIR
from dsh_dev.localstack.process import (
    ChildProcess,
    find_java,
    free_ports,
    port_is_free,
    wait_until,
)
from pipeline.adapters.secure.security import SecureSetup
from pipeline.core.errors import BrokerError, ConfigError

READY_BUDGET_S: Final = 60.0
FORMAT_TIMEOUT_S: Final = 300.0  # seconds on an idle machine; minutes under heavy load
PROBE_TIMEOUT_MS: Final = 2_000
# A broker's controlled shutdown waits for the controller; past this it is killed.
STOP_TIMEOUT_S: Final = 10.0
# A killed node is noticed in seconds rather than the default 9 s, so failover tests stay short.
CLUSTER_FAILURE_DETECTION: Final = (
    "broker.heartbeat.interval.ms=1000\nbroker.session.timeout.ms=4000")


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """Ports and folders of one node."""

    node_id: int
    port: int
    controller_port: int
    home: Path

    @property
    def properties(self) -> Path:
        return self.home / "server.properties"

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def log_path(self) -> Path:
        return self.home / "kafka.log"


def new_cluster_id() -> str:
    """16 random bytes, URL-safe base64 without padding (as ``kafka-storage random-uuid``).

    An id starting with ``-`` would be read by the storage tool's argument parser as an option
    (about 1 start in 64 failed so), so such ids are drawn again, as Kafka's own tool does.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


class KafkaLocal:
    """One local Kafka: ``nodes`` combined broker+controller processes on free loopback ports."""

    def __init__(self, lib_dir: Path, workdir: Path | None = None, *, nodes: int = 1,
                 port: int | None = None, heap_mb: int = 512,
                 security: SecureSetup | None = None) -> None:
        if nodes not in (1, 3):
            raise ConfigError(f"a local Kafka has 1 or 3 nodes, not {nodes}")
        self.lib_dir = lib_dir
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="dsh-kafka-"))
        self.heap_mb = heap_mb
        self.security = security
        self.cluster_id = new_cluster_id()
        self.nodes = _plan_nodes(self.workdir, nodes, port)
        self._java = ""
        self._procs: dict[int, ChildProcess] = {}

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def __enter__(self) -> KafkaLocal:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, budget_s: float = READY_BUDGET_S) -> None:
        """Format, launch and wait until ready (raises :class:`BrokerError` with the log tail)."""
        self.launch()
        self.wait_ready(budget_s)

    def launch(self) -> None:
        """Format storage and start the node processes without waiting for readiness."""
        self._java = find_java(17)
        for node in self.nodes:
            node.home.mkdir(parents=True, exist_ok=True)
            node.properties.write_text(self._render(node), encoding="utf-8")
        with concurrent.futures.ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(self._format, self.nodes))
        for node in self.nodes:
            self._procs[node.node_id] = ChildProcess(
                f"kafka node {node.node_id}", self._server_argv(node), node.log_path, node.home)

    def wait_ready(self, budget_s: float = READY_BUDGET_S) -> None:
        """Block until every node answers metadata requests, or raise with the log tails."""
        deadline = time.monotonic() + budget_s
        while True:
            dead = self.dead_nodes()
            if dead:
                raise BrokerError(self._failure(f"node {dead[0].node_id} exited", dead[0]))
            listening = all(_accepts(n.port) for n in self.nodes)
            if listening and _run_blocking(_count_brokers(
                    self.bootstrap, self.probe_options())) >= len(self.nodes):
                return
            if not wait_until(deadline, 0.25):
                raise BrokerError(self._failure(f"not ready within {budget_s:.0f} s",
                                                self.nodes[0]))

    def probe_options(self) -> dict[str, Any]:
        """aiokafka options of the readiness probe: the admin principal when secure."""
        if self.security is None:
            return {}
        ctx = ssl.create_default_context(cafile=str(self.security.pki.ca_file))
        return {"security_protocol": "SASL_SSL", "ssl_context": ctx,
                "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "admin",
                "sasl_plain_password": self.security.password("admin")}

    def pid(self, node_id: int) -> int:
        return self._procs[node_id].pid

    def kill9(self, node_id: int) -> None:
        """SIGKILL one node (failure tests)."""
        self._procs[node_id].kill9()

    def restart(self, node_id: int) -> None:
        """Start a node again (after :meth:`kill9`) on its existing storage, same ports."""
        [node] = [n for n in self.nodes if n.node_id == node_id]
        self._procs[node_id] = ChildProcess(
            f"kafka node {node_id}", self._server_argv(node), node.log_path, node.home)

    def alive(self, node_id: int) -> bool:
        proc = self._procs.get(node_id)
        return proc is not None and proc.alive()

    def dead_nodes(self) -> list[NodeSpec]:
        """Nodes that were started and have exited (killed by a test, or crashed)."""
        return [n for n in self.nodes
                if n.node_id in self._procs and not self._procs[n.node_id].alive()]

    def stop(self) -> None:
        """Stop every node, then remove a temporary workdir.

        Nodes whose storage is kept get SIGTERM (then SIGKILL after ``STOP_TIMEOUT_S``); the
        nodes of a temporary workdir get SIGKILL at once: their storage is removed next, and a
        3-node cluster stopped as a whole waits out its controlled shutdowns (the quorum goes
        first) for 6-10 s, for nothing.
        """
        if self._own_workdir:
            for proc in self._procs.values():
                proc.kill9()
        for proc in self._procs.values():
            proc.terminate()
        for proc in self._procs.values():
            proc.wait_stopped(STOP_TIMEOUT_S)
        self._procs.clear()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _render(self, node: NodeSpec) -> str:
        template = string.Template((DEPLOY_DIR / "server.properties.template").read_text())
        if len(self.nodes) == 1:
            quorum = f"controller.quorum.bootstrap.servers=127.0.0.1:{node.controller_port}"
        else:
            voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
            quorum = f"controller.quorum.voters={voters}"
        rf = len(self.nodes)
        if self.security is None:
            listeners = _plain_listeners(node.port, node.controller_port)
            security = ""
        else:
            listeners = self.security.listener_lines(node.port, node.controller_port)
            security = self.security.server_properties()
        return template.substitute(
            node_id=node.node_id, quorum_line=quorum, listener_lines=listeners,
            security_lines=security, log_dir=node.data_dir,
            replication_factor=rf, min_isr=min(rf, 2), internal_partitions=1 if rf == 1 else 3,
            failure_detection="" if rf == 1 else CLUSTER_FAILURE_DETECTION,
        )

    def _classpath(self) -> str:
        return str(self.lib_dir / "*")

    def _format(self, node: NodeSpec) -> None:
        argv = [self._java, "-Xmx256m", "-cp", self._classpath(), "kafka.tools.StorageTool",
                "format", "-t", self.cluster_id, "-c", str(node.properties)]
        if len(self.nodes) == 1:
            argv.append("--standalone")
        if self.security is not None:
            argv += self.security.scram_format_args()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False,
                                  timeout=FORMAT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BrokerError(
                f"formatting Kafka storage of node {node.node_id} failed: {exc}") from None
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            raise BrokerError(f"formatting Kafka storage of node {node.node_id} failed "
                              f"(exit {done.returncode}):\n{tail}")

    def _server_argv(self, node: NodeSpec) -> list[str]:
        return [
            self._java, f"-Xms{self.heap_mb}m", f"-Xmx{self.heap_mb}m", "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={node.home}",
            f"-Dlog4j2.configurationFile={DEPLOY_DIR / 'log4j2.properties'}",
            "-cp", self._classpath(), "kafka.Kafka", str(node.properties),
        ]

    def _failure(self, what: str, node: NodeSpec) -> str:
        proc = self._procs[node.node_id]
        return (f"local Kafka at {self.bootstrap}: {what}; last lines of {node.log_path}:\n"
                f"{proc.log_tail()}")


def _plain_listeners(port: int, controller_port: int) -> str:
    listeners = f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}"
    return "\n".join([
        f"listeners={listeners}", f"advertised.listeners={listeners}",
        "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "controller.listener.names=CONTROLLER", "inter.broker.listener.name=PLAINTEXT"])


def _plan_nodes(workdir: Path, count: int, port: int | None) -> list[NodeSpec]:
    ports = free_ports(2 * count)
    if port is not None:
        if not port_is_free(port):
            raise ConfigError(f"Kafka port {port} on 127.0.0.1 is already in use")
        ports = [port, *(p for p in ports if p != port)]
    return [NodeSpec(i + 1, ports[2 * i], ports[2 * i + 1], workdir / f"node-{i + 1}")
            for i in range(count)]


def _accepts(port: int) -> bool:
    """Whether 127.0.0.1:port accepts a TCP connection (checked first, so that the admin probe
    does not log a connection error per attempt while the JVM is still starting)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


async def _count_brokers(bootstrap: str, options: dict[str, Any]) -> int:
    """Brokers in the cluster's metadata, 0 when it does not answer (yet)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=PROBE_TIMEOUT_MS,
                                **options)
    try:
        await admin.start()
        cluster = await admin.describe_cluster()
        await admin.list_topics()
        return len(cluster.get("brokers", []))
    except Exception:  # readiness probe: any failure just means "not yet"
        return 0
    finally:
        await admin.close()


def _run_blocking(coro: object) -> int:
    """Run a probe coroutine to completion, also when the caller's thread runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()  # type: ignore[arg-type]
