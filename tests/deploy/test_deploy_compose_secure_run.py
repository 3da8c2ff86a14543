"""The secure compose configuration, run: a local Kafka started with the configuration the
``kafka`` container would get, and clients with the settings its services would get.

No Docker engine here, so the containers' parts run as local processes, with only their
addresses moved to free loopback ports and their mount paths to a temporary folder:
``dsh-pipeline certs``'s generator writes the secrets folder (as the ``certs`` service); the
``kafka-format`` service's entrypoint builds the broker's configuration and its command formats
with the SCRAM users (Kafka's own storage tool); Kafka starts by the ``kafka`` service's own
entrypoint and command;
the generated ``create-acls.sh`` runs Kafka's own ``kafka-acls``; then each service's
principal (its compose environment plus its env file) is allowed what its role needs and
refused the rest. Apicurio starts with the registry service's environment and its generated
users file.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import TopicAuthorizationFailedError
from test_deploy_compose import service_env
from test_deploy_compose_secure import ROLE_OF_SERVICE, merged_config

from dsh_dev.localstack.artifacts import DEPLOY_DIR, Artifacts
from dsh_dev.localstack.process import ChildProcess, find_java, free_ports
from dsh_dev.localstack.registry import APICURIO_MIN_JAVA, CCOMPAT_PATH
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.secure.compose import KAFKA_MOUNT, SECRETS_MOUNT, write_compose_secrets
from pipeline.adapters.secure.security import read_env_file
from pipeline.cli.cmd_certs import certificate_hosts
from pipeline.settings import Secret, Settings

# The compose stack's broker (and its registry) run here, from the Java artifacts of the cache.
pytestmark = [pytest.mark.broker, pytest.mark.jars]
READY_BUDGET_S = 240.0


class ComposeBroker:
    """The compose stack's Kafka as a local process, and its services' settings."""

    def __init__(self, folder: Path) -> None:
        result = merged_config()
        assert result.returncode == 0, result.stderr
        self.services: dict[str, Any] = json.loads(result.stdout.replace("$$", "$"))["services"]
        self.folder = folder
        port, controller, host = free_ports(3)
        self.bootstrap, self.host_bootstrap = f"127.0.0.1:{port}", f"localhost:{host}"
        self.moves = {  # container address or path -> its local stand-in
            "SASL_SSL://:19092": f"SASL_SSL://127.0.0.1:{port}",
            "CONTROLLER://:9093": f"CONTROLLER://127.0.0.1:{controller}",
            "HOST://:9092": f"HOST://127.0.0.1:{host}",
            "kafka:19092": self.bootstrap, "kafka:9093": f"127.0.0.1:{controller}",
            "localhost:9092": self.host_bootstrap,
            "/var/lib/kafka/data": str(folder / "data"),
            "/tmp/server.properties": str(folder / "server.properties"),
            "/opt/kafka/bin/": f"{folder / 'bin'}/",
            KAFKA_MOUNT: str(folder / "secrets" / "kafka"),
        }
        self.process: ChildProcess | None = None

    def move(self, text: str) -> str:
        for old, new in self.moves.items():
            text = text.replace(old, new)
        return text

    def write_secrets(self) -> None:
        certs = Settings.from_env(service_env(self.services["certs"]))
        secrets = self.folder / "secrets"
        assert write_compose_secrets(secrets, certs, certificate_hosts(certs, []))
        for name in ("server.properties", "admin-client.properties", "create-acls.sh"):
            path = secrets / "kafka" / name
            path.write_text(self.move(path.read_text()))

    def write_tools(self, artifacts: Artifacts) -> None:
        """kafka-storage.sh and kafka-acls.sh as the image's bin/ runs them."""
        java = find_java(17)
        classpath = f"{artifacts.require_kafka()}/*:{artifacts.require_acl_tool()}/*"
        for name, main in (("kafka-storage.sh", "kafka.tools.StorageTool"),
                           ("kafka-acls.sh", "org.apache.kafka.tools.AclCommand")):
            tool = self.folder / "bin" / name
            tool.parent.mkdir(exist_ok=True)
            tool.write_text(f'#!/bin/sh\nexec {java} -Xmx128m -XX:TieredStopAtLevel=1 '
                            f'-cp "{classpath}" {main} "$@"\n')
            tool.chmod(0o755)

    def run_script(self, service: str, script: list[str]) -> None:
        env = {**{k: self.move(v) for k, v in service_env(self.services[service]).items()},
               "PATH": os.environ["PATH"]}
        done = subprocess.run([self.move(arg) for arg in script], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{service}:\n{done.stdout}\n{done.stderr}"

    def start(self) -> None:
        """Kafka as the ``kafka`` service starts it: its entrypoint builds the configuration
        (the mounted server.properties, then its KAFKA_* variables), its command starts the
        broker (``kafka-server-start.sh``, standing in for the image's)."""
        java = find_java(17)
        lib = Artifacts.default().require_kafka()
        start = self.folder / "bin" / "kafka-server-start.sh"
        start.write_text(f'#!/bin/sh\nexec {java} -Xmx384m -Dkafka.logs.dir={self.folder} '
                         f'-Dlog4j2.configurationFile={DEPLOY_DIR / "log4j2.properties"} '
                         f'-cp "{lib}/*" kafka.Kafka "$1"\n')
        start.chmod(0o755)
        service = self.services["kafka"]
        env = {**{k: self.move(v) for k, v in service_env(service).items()},
               "PATH": os.environ["PATH"]}
        argv = [self.move(arg) for arg in [*service["entrypoint"], *service["command"]]]
        self.process = ChildProcess("compose kafka", argv, self.folder / "kafka.log",
                                    self.folder, env=env)

    def settings(self, service: str, *, host: bool = False) -> Settings:
        """The service's settings: its compose environment, then its env file."""
        role = ROLE_OF_SERVICE[service]
        env = {**service_env(self.services[service]),
               **read_env_file(self.folder / "secrets" / role / "dsh.env")}
        env = {k: v.replace(SECRETS_MOUNT, str(self.folder / "secrets" / role))
               for k, v in env.items()}
        env["DSH_BOOTSTRAP_SERVERS"] = self.host_bootstrap if host else self.bootstrap
        return Settings.from_env(env)

    def wait_ready(self, settings: Settings) -> None:
        deadline = time.monotonic() + READY_BUDGET_S
        while not asyncio.run(_answers(settings)):
            assert self.process is not None and self.process.alive(), self.process.log_tail()
            assert time.monotonic() < deadline, self.process.log_tail()
            time.sleep(1)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


async def _answers(settings: Settings) -> bool:
    admin = AIOKafkaAdminClient(request_timeout_ms=3000, **client_options(settings))
    try:
        await admin.start()
        await admin.list_topics()
        return True
    except Exception:  # not ready yet
        return False
    finally:
        await admin.close()


def _missing(what: str) -> None:
    # `make test` (and so CI) fetches them first: there, a missing artifact is a broken install.
    if os.environ.get("CI"):
        pytest.fail(what)
    pytest.skip(what)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeBroker]:
    artifacts = Artifacts.default()
    if not (artifacts.kafka_lib.is_dir() and artifacts.acl_tool_ready()):
        _missing("Kafka and its ACL tool are not in the cache (broker --secure --fetch-only)")
    stack = ComposeBroker(tmp_path_factory.mktemp("compose-kafka"))
    try:
        stack.write_secrets()
        stack.write_tools(artifacts)
        stack.run_script("kafka-format", [*stack.services["kafka-format"]["entrypoint"],
                                          *stack.services["kafka-format"]["command"]])
        stack.start()
        admin = stack.settings("topics")
        stack.wait_ready(admin)
        asyncio.run(ensure_topics(admin))
        stack.run_script("kafka-acls", stack.services["kafka-acls"]["command"])
        yield stack
    finally:
        stack.stop()


async def _send(settings: Settings, topic: str) -> None:
    producer = AIOKafkaProducer(request_timeout_ms=15000, **client_options(settings))
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"x", key=uuid.uuid4().bytes)
    finally:
        await producer.stop()


def test_the_broker_runs_the_file_its_entrypoint_builds(broker: ComposeBroker) -> None:
    properties = (broker.folder / "server.properties").read_text()
    assert "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer" in (
        properties)
    assert broker.process is not None and broker.process.alive()


def test_each_service_is_allowed_its_roles_writes(broker: ComposeBroker) -> None:
    driver = broker.settings("driver")
    asyncio.run(_send(driver, driver.topics.session_events))


def test_each_service_is_refused_what_its_role_may_not_do(broker: ComposeBroker) -> None:
    driver, dashboard = broker.settings("driver"), broker.settings("dashboard")
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(_send(driver, driver.topics.inbox))
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(_send(dashboard, dashboard.topics.session_events))


def test_the_host_listener_takes_scram_logins_over_tls(broker: ComposeBroker) -> None:
    assert asyncio.run(_answers(broker.settings("dashboard", host=True)))
    wrong = broker.settings("dashboard", host=True)
    assert not asyncio.run(_answers(replace(wrong, sasl_password=Secret("not-the-password"))))


# --- the registry, started with the registry service's environment ------------------------

class ComposeRegistry:
    """Apicurio started with the compose registry's environment (its port and mount moved)."""

    def __init__(self, folder: Path, services: dict[str, Any]) -> None:
        self.folder = folder
        self.port, plain, management = free_ports(3)
        env = service_env(services["registry"])
        self.env = {k: v.replace(SECRETS_MOUNT, str(folder / "secrets" / "registry"))
                    for k, v in env.items()}
        self.env |= {"QUARKUS_HTTP_SSL_PORT": str(self.port), "QUARKUS_HTTP_PORT": str(plain),
                     "QUARKUS_HTTP_HOST": "127.0.0.1", "QUARKUS_MANAGEMENT_HOST": "127.0.0.1",
                     "QUARKUS_MANAGEMENT_PORT": str(management), "PATH": os.environ["PATH"]}
        self.process: ChildProcess | None = None

    def start(self) -> None:
        jar = Artifacts.default().require_apicurio()
        argv = [find_java(APICURIO_MIN_JAVA), "-Xmx384m", "-XX:+UseSerialGC",
                f"-Djava.io.tmpdir={self.folder}", "-jar", str(jar)]
        self.process = ChildProcess("compose registry", argv, self.folder / "registry.log",
                                    jar.parent, env=self.env)
        deadline = time.monotonic() + READY_BUDGET_S
        while self.status("GET", "/subjects", "dashboard") != 200:
            assert self.process.alive(), self.process.log_tail()
            assert time.monotonic() < deadline, self.process.log_tail()
            time.sleep(1)

    def status(self, method: str, path: str, principal: str | None,
               body: bytes | None = None) -> int:
        """The HTTP status of one request over TLS (trusting the compose CA) as ``principal``
        (its password from its env file), or unauthenticated; 0 when nothing answers."""
        request = urllib.request.Request(
            f"https://127.0.0.1:{self.port}{CCOMPAT_PATH}{path}", data=body, method=method,
            headers={"Content-Type": "application/vnd.schemaregistry.v1+json"})
        if principal is not None:
            env = read_env_file(self.folder / "secrets" / principal / "dsh.env")
            token = f"{principal}:{env['DSH_REGISTRY_PASSWORD']}".encode()
            request.add_header("Authorization", "Basic " + base64.b64encode(token).decode())
        context = ssl.create_default_context(cafile=str(self.folder / "secrets" / "kafka" /
                                                        "ca.pem"))
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return int(error.code)
        except (urllib.error.URLError, OSError):
            return 0

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@pytest.fixture(scope="module")
def registry(broker: ComposeBroker) -> Iterator[ComposeRegistry]:
    if not Artifacts.default().apicurio_ready():
        _missing("Apicurio is not in the cache (dsh-pipeline broker --fetch-only)")
    started = ComposeRegistry(broker.folder, broker.services)
    try:
        started.start()
        yield started
    finally:
        started.stop()


@pytest.mark.registry
def test_registry_serves_https_with_the_generated_users(registry: ComposeRegistry) -> None:
    schema = json.dumps({"schema": json.dumps({"type": "string"})}).encode()
    path = f"/subjects/compose-{uuid.uuid4().hex}-value/versions"
    assert registry.status("GET", "/subjects", None) == 401
    assert registry.status("POST", path, "driver", schema) == 403
    assert registry.status("POST", path, "admin", schema) == 200
    assert registry.status("GET", path, "processors") == 200
