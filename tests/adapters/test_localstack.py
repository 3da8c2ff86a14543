"""The local stack: artifacts cache, rendered configs, child processes that never outlive their
parent, clear start-up failures, and the ``broker``/``demo`` commands end to end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from dsh_dev.localstack.artifacts import (
    MARKER,
    Artifacts,
    _log4j_core_version,
    ensure_artifacts,
)
from dsh_dev.localstack.kafka import KafkaLocal, new_cluster_id
from dsh_dev.localstack.process import ChildProcess, find_java, free_ports
from dsh_dev.localstack.registry import RegistryLocal
from pipeline.adapters.kafka.admin import plan_topics
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import BrokerError, ConfigError, RegistryError
from pipeline.settings import Settings

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "pipeline.cli.main"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): read its state.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _wait_dead(pid: int, budget_s: float = 10.0) -> bool:
    deadline = time.monotonic() + budget_s
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- artifacts ---------------------------------------------------------------------------

def test_cached_artifacts_are_not_resolved_again(tmp_path: Path) -> None:
    artifacts = Artifacts(tmp_path)
    for folder in (artifacts.kafka_dir, artifacts.apicurio_dir):
        folder.mkdir(parents=True)
        (folder / MARKER).write_text("resolved\n")
    lines: list[str] = []
    ensure_artifacts(artifacts, progress=lines.append)  # would call Maven if not cached
    assert lines == [f"Kafka 4.4.0: cached in {artifacts.kafka_dir}",
                     f"Apicurio Registry 3.3.3: cached in {artifacts.apicurio_dir}"]


def test_missing_artifacts_say_how_to_get_them(tmp_path: Path) -> None:
    artifacts = Artifacts(tmp_path)
    (artifacts.kafka_dir / "lib").mkdir(parents=True)  # a folder without marker: incomplete
    with pytest.raises(ConfigError, match="make setup"):
        artifacts.require_kafka()
    with pytest.raises(ConfigError, match="Apicurio Registry artifacts are not in"):
        artifacts.require_apicurio()


def test_log4j_binding_version_comes_from_kafkas_tree() -> None:
    tree = ("[INFO] |  +- org.apache.logging.log4j:log4j-api:jar:2.25.5:runtime\n"
            "[INFO] |  \\- org.apache.logging.log4j:log4j-core:jar:2.25.5:runtime\n")
    assert _log4j_core_version(tree) == "2.25.5"


@pytest.mark.jars
def test_resolved_kafka_classpath_has_the_slf4j_binding() -> None:
    lib = Artifacts.default().require_kafka()
    names = {p.name for p in lib.glob("*.jar")}
    core = [n for n in names if n.startswith("log4j-core-")]
    assert core and core[0].replace("log4j-core-", "log4j-slf4j-impl-") in names
    assert "kafka_2.13-4.4.0.jar" in names
    assert not [n for n in names if n.startswith("connect-runtime")]


# --- configuration -------------------------------------------------------------------------

def test_single_node_config_uses_a_dynamic_quorum(tmp_path: Path) -> None:
    kafka = KafkaLocal(tmp_path / "lib", tmp_path / "k")
    rendered = kafka._render(kafka.nodes[0])
    node = kafka.nodes[0]
    assert f"controller.quorum.bootstrap.servers=127.0.0.1:{node.controller_port}" in rendered
    assert "controller.quorum.voters" not in rendered
    assert "offsets.topic.replication.factor=1\n" in rendered
    assert "min.insync.replicas=1\n" in rendered
    assert f"listeners=PLAINTEXT://127.0.0.1:{node.port}," in rendered
    assert "$" not in rendered


def test_cluster_config_has_static_voters_rf3_and_min_isr2(tmp_path: Path) -> None:
    kafka = KafkaLocal(tmp_path / "lib", tmp_path / "k", nodes=3)
    voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in kafka.nodes)
    ports = {n.port for n in kafka.nodes} | {n.controller_port for n in kafka.nodes}
    assert len(ports) == 6
    for node in kafka.nodes:
        rendered = kafka._render(node)
        assert f"node.id={node.node_id}\n" in rendered
        assert f"controller.quorum.voters={voters}\n" in rendered
        for line in ("default.replication.factor=3", "min.insync.replicas=2",
                     "transaction.state.log.min.isr=2", "offsets.topic.replication.factor=3"):
            assert line + "\n" in rendered
    assert kafka.bootstrap == ",".join(f"127.0.0.1:{n.port}" for n in kafka.nodes)


def test_cluster_id_is_22_url_safe_characters() -> None:
    ids = {new_cluster_id() for _ in range(20)}
    assert len(ids) == 20
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{22}", i) for i in ids)


def test_a_busy_port_is_refused(tmp_path: Path) -> None:
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port}"):
            KafkaLocal(tmp_path, port=port)
        with pytest.raises(ConfigError, match=f"port {port}"):
            RegistryLocal(tmp_path / "x.jar", port=port)


# --- processes -------------------------------------------------------------------------------

def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    script = "import subprocess, sys, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    child = ChildProcess("sleeper", [sys.executable, "-c", script], tmp_path / "log", tmp_path)
    time.sleep(0.5)
    group = [int(p) for p in subprocess.run(["pgrep", "-g", str(child.pid)], capture_output=True,
                                            text=True).stdout.split()]
    assert child.pid in group and len(group) == 2
    child.stop(timeout_s=5)
    assert not child.alive()
    assert all(_wait_dead(pid) for pid in group)


def test_children_die_with_a_sigkilled_parent(tmp_path: Path) -> None:
    parent_code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from dsh_dev.localstack.process import ChildProcess
        child = ChildProcess("sleeper", ["sleep", "300"], Path({str(tmp_path / 'log')!r}),
                             Path({str(tmp_path)!r}))
        print(child.pid, flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                              text=True, cwd=REPO)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    assert _pid_alive(child_pid)
    parent.kill()
    parent.wait()
    assert _wait_dead(child_pid), "the child outlived its SIGKILLed parent"


def test_log_tail_keeps_the_cause_and_drops_java_stack_frames(tmp_path: Path) -> None:
    output = ("start\\nException: boom\\n\\tat a.B(B.java:1)\\n\\t... 3 more\\n"
              "Caused by: port busy\\n")
    child = ChildProcess("printer", ["printf", output], tmp_path / "log", tmp_path)
    assert child.wait_stopped(10) == 0
    assert child.log_tail() == "start\nException: boom\nCaused by: port busy"
    assert child.log_tail(lines=1) == "Caused by: port busy"


@pytest.mark.jars  # runs Java (Kafka's storage tool, whose class is missing)
def test_kafka_that_cannot_start_fails_with_its_output(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()  # no jars: the storage tool's class is missing
    kafka = KafkaLocal(tmp_path / "lib", tmp_path / "k")
    with pytest.raises(BrokerError, match=r"formatting Kafka storage of node 1 failed") as err:
        kafka.start(budget_s=30)
    assert "StorageTool" in str(err.value)
    kafka.stop()


@pytest.mark.jars  # runs Java 21+ on a file that is not a jar
def test_registry_that_exits_fails_with_its_log_tail(tmp_path: Path) -> None:
    jar = tmp_path / "not-a.jar"
    jar.write_text("not a jar")
    registry = RegistryLocal(jar, tmp_path / "r")
    try:
        with pytest.raises(RegistryError, match=r"exited with \d+; last lines of .*registry.log"):
            registry.start(budget_s=30)
    finally:
        registry.stop()


def test_find_java_names_what_it_tried() -> None:
    with pytest.raises(ConfigError, match="no Java 99\\+ found; tried: "):
        find_java(99)


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(1024 <= p <= 65535 for p in ports)


# --- the fixture registry -------------------------------------------------------------------

def test_fixture_registry_has_backward_transitive_compatibility(registry_url: str) -> None:
    with urllib.request.urlopen(registry_url + "/config", timeout=10) as response:
        config = json.loads(response.read())
    assert config["compatibilityLevel"] == "BACKWARD_TRANSITIVE"


# --- the commands, end to end ---------------------------------------------------------------

@pytest.mark.broker
@pytest.mark.jars
@pytest.mark.timeout(700)
def test_broker_command_serves_the_demo_and_stops_on_sigterm(tmp_path: Path) -> None:
    env = {**os.environ, "DSH_TOPIC_PREFIX": "brokercmd.", "DSH_PARTITIONS": "2"}
    broker = subprocess.Popen([*CLI, "broker", "--port", "0", "--registry-port", "0",
                               "--ready-timeout", "300"], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=tmp_path.joinpath(
                                  "broker.err").open("w"), text=True)
    try:
        assert broker.stdout is not None
        ready = broker.stdout.readline()
        match = re.fullmatch(r"ready bootstrap=(127\.0\.0\.1:\d+) "
                             r"registry=(http://127\.0\.0\.1:\d+/apis/ccompat/v7)\n", ready)
        errors = [line for line in tmp_path.joinpath("broker.err").read_text().splitlines()
                  if not line.startswith(("\tat ", "\t..."))]
        assert match, (ready, errors[-60:])
        demo = subprocess.run(
            [*CLI, "demo", "--external", "--sessions", "2", "--turns", "1"], cwd=REPO,
            capture_output=True, text=True, timeout=400,
            env={**env, "DSH_BOOTSTRAP_SERVERS": match[1], "DSH_REGISTRY_URL": match[2],
                 "DSH_DASHBOARD_PORT": str(free_ports(1)[0])})
        assert demo.returncode == 0, demo.stderr
        summary = dict(item.split("=", 1) for item in demo.stdout.split())
        assert demo.stdout.count("\n") == 1
        samples = [read_session_file(p) for p in (REPO / "samples" / "sessions").glob("*.jsonl")]
        assert summary == {
            "sessions": str(len(samples)), "events": str(sum(len(s.events) for s in samples)),
            "roundtrip_ok": "true", "fleet_sessions": "2",
            "fleet_events": summary["fleet_events"], "turns": "2", "steps": "4",
            "invalid_logs": "0", "session_failures": "0", "derived_mismatches": "0",
            "usage_mismatches": "0"}
        assert int(summary["fleet_events"]) > 2 * 10
        planned = len(plan_topics(Settings()))
        assert f"topics: 0 created, {planned} existing" in demo.stderr  # the broker made them
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(timeout=60) == 0
        assert broker.stdout.read() == ""  # exactly one line on stdout
    finally:
        if broker.poll() is None:
            broker.kill()
