"""The Kafka of docker-compose.yml, run for real: its KAFKA_* environment, turned into
server.properties the way the apache/kafka image does, formats (with the file's CLUSTER_ID)
and starts a Kafka 4 node that the services reach on the listener they are given, with
automatic topic creation off, and on which the services' topic plan can be created.

No Docker here: the node runs from the project's local Kafka jars (the same major version as
the image), on free loopback ports instead of the container's ones.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from dsh_dev.localstack.artifacts import DEPLOY_DIR, Artifacts
from dsh_dev.localstack.process import ChildProcess, find_java, free_ports
from pipeline.adapters.kafka.admin import ensure_topics, plan_topics
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
# Variables the image's scripts use themselves instead of writing them to server.properties.
IMAGE_VARIABLES = {"CLUSTER_ID", "KAFKA_HEAP_OPTS", "KAFKA_OPTS", "KAFKA_JVM_PERFORMANCE_OPTS",
                   "KAFKA_LOG4J_OPTS", "KAFKA_JMX_OPTS", "KAFKA_GC_LOG_OPTS", "KAFKA_VERSION"}



def compose_kafka_env() -> dict[str, str]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return {k: str(v) for k, v in compose["services"]["kafka"]["environment"].items()}


def property_name(variable: str) -> str:
    """apache/kafka's rule: drop KAFKA_, lower-case, ``___`` -> ``-``, ``__`` -> ``_``,
    ``_`` -> ``.``."""
    name = variable.removeprefix("KAFKA_").lower()
    return name.replace("___", "-").replace("__", "\0").replace("_", ".").replace("\0", "_")


def test_property_names_follow_the_image_rule() -> None:
    assert property_name("KAFKA_ADVERTISED_LISTENERS") == "advertised.listeners"
    assert property_name("KAFKA_FOO__BAR") == "foo_bar"
    assert property_name("KAFKA_FOO___BAR") == "foo-bar"


def relocate(value: str, ports: dict[int, int]) -> str:
    """Container addresses -> loopback: host names to 127.0.0.1, the file's ports to free
    ones (a bind address ``://:PORT`` gets the loopback host too)."""
    value = re.sub(r"(?<=//)(kafka|localhost)?(?=:\d)", "127.0.0.1", value)
    value = re.sub(r"(?<=@)kafka(?=:\d)", "127.0.0.1", value)
    return re.sub(r"(?<=:)(\d+)\b", lambda m: str(ports.get(int(m.group(1)), m.group(1))), value)


@dataclass
class ComposeKafka:
    bootstrap: str      # what DSH_BOOTSTRAP_SERVERS names (kafka:19092 in the stack)
    host_bootstrap: str  # what the host uses (localhost:9092 in the stack)


@pytest.fixture(scope="module")
def compose_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeKafka]:
    lib = Artifacts.default().require_kafka()
    env = compose_kafka_env()
    original_ports = sorted({int(p) for v in env.values() for p in re.findall(r":(\d{4,5})\b", v)})
    ports = dict(zip(original_ports, free_ports(len(original_ports)), strict=True))
    home = tmp_path_factory.mktemp("compose-kafka")
    lines = [f"{property_name(k)}={relocate(v, ports)}" for k, v in sorted(env.items())
             if k not in IMAGE_VARIABLES]
    lines.append(f"log.dirs={home / 'data'}")  # the image's default is inside the container
    properties = home / "server.properties"
    properties.write_text("\n".join(lines) + "\n")
    java = find_java(17)
    formatted = subprocess.run(
        [java, "-Xmx256m", "-cp", f"{lib}/*", "kafka.tools.StorageTool", "format",
         "-t", env["CLUSTER_ID"], "-c", str(properties)],
        capture_output=True, text=True, timeout=120)
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
    node = ChildProcess("compose kafka", [
        java, "-Xms384m", "-Xmx384m", f"-Dkafka.logs.dir={home}",
        f"-Dlog4j2.configurationFile={DEPLOY_DIR / 'log4j2.properties'}",
        "-cp", f"{lib}/*", "kafka.Kafka", str(properties)], home / "kafka.log", home)
    try:
        yield ComposeKafka(bootstrap=f"127.0.0.1:{ports[19092]}",
                           host_bootstrap=f"127.0.0.1:{ports[9092]}")
    finally:
        node.terminate()
        node.wait_stopped(15)


async def broker_config(bootstrap: str, budget_s: float = 60.0) -> dict[str, str]:
    """The broker's effective configuration, once it answers (or fail after the budget)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000)
        try:
            await admin.start()
            (answer,) = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.BROKER, "1")])
            return {entry[0]: entry[1] for entry in answer.resources[0][4]}
        except Exception:  # not up yet: retried until the budget runs out
            if loop.time() > deadline:
                raise
        finally:
            await admin.close()
        await asyncio.sleep(0.5)


@pytest.mark.broker
@pytest.mark.jars
def test_compose_kafka_serves_both_listeners_without_auto_topic_creation(
        compose_kafka: ComposeKafka) -> None:
    for bootstrap in (compose_kafka.bootstrap, compose_kafka.host_bootstrap):
        config = asyncio.run(broker_config(bootstrap))
        assert config["auto.create.topics.enable"] == "false"
        assert config["process.roles"] == "broker,controller"


@pytest.mark.broker
@pytest.mark.jars
def test_the_services_topic_plan_is_created_on_it(compose_kafka: ComposeKafka) -> None:
    settings = Settings.from_env({"DSH_BOOTSTRAP_SERVERS": compose_kafka.bootstrap})
    asyncio.run(broker_config(settings.bootstrap_servers))
    report = asyncio.run(ensure_topics(settings))
    assert set(report.created) == {spec.name for spec in plan_topics(settings)}
    again = asyncio.run(ensure_topics(settings))  # idempotent, as `topics ensure` reruns
    assert again.created == ()
