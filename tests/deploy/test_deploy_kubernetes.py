"""deploy/kubernetes, validated offline: the Kubernetes schemas (kubernetes-validate, strict),
a documented subset of the Strimzi CRDs, and the manifests kept in step with the settings and
the topology of DESIGN.md (topics, co-partitioning, secrets, ports, scaling bounds)."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pipeline.adapters.kafka.admin import plan_topics
from pipeline.adapters.secure.acls import acl_plan
from pipeline.adapters.secure.registry_auth import (
    EMBEDDED_ROLES_ENV,
    EMBEDDED_USERS_ENV,
    quarkus_env_name,
    registry_role,
    secure_registry_properties,
)
from pipeline.adapters.secure.security import ROLES
from pipeline.cli.main import build_parser
from pipeline.services.processors.options import ProcessorsOptions
from pipeline.settings import Secret, Settings, TopicNames

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "kubernetes"
STRIMZI_SCHEMA = Path(__file__).parent / "schemas" / "strimzi-v1beta2-subset.json"
KUBERNETES_VERSION = "1.33"
SETTINGS_VARS = {f"DSH_{f.name.upper()}" for f in fields(Settings)}
SECRET_VARS = {f"DSH_{f.name.upper()}" for f in fields(Settings)
               if isinstance(getattr(Settings(), f.name), Secret)}
PORT_OF_WORKLOAD = {
    "driver": Settings().driver_metrics_port,
    "processors": Settings().processors_web_port,
    "dashboard": Settings().dashboard_port,
    "otel": Settings().otel_metrics_port,
}
Resource = dict[str, Any]


def kustomization() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    return loaded


def load_resources() -> list[Resource]:
    docs: list[Resource] = []
    for name in kustomization()["resources"]:
        docs.extend(d for d in yaml.safe_load_all((K8S_DIR / name).read_text()) if d)
    return docs


RESOURCES = load_resources()


def of_kind(kind: str) -> list[Resource]:
    return [r for r in RESOURCES if r["kind"] == kind]


def named(kind: str, name: str) -> Resource:
    matches = [r for r in of_kind(kind) if r["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name!r}, found {len(matches)}"
    return matches[0]


def workloads() -> list[Resource]:
    return [r for r in RESOURCES if r["kind"] in {"Deployment", "StatefulSet", "Job"}]


def containers(workload: Resource) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = workload["spec"]["template"]["spec"]["containers"]
    return found


def dsh_containers() -> Iterator[tuple[Resource, dict[str, Any]]]:
    for workload in workloads():
        for container in containers(workload):
            if container["image"].startswith("dsh-pipeline"):
                yield workload, container


def strimzi_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(STRIMZI_SCHEMA.read_text())
    validator: jsonschema.protocols.Validator = jsonschema.Draft202012Validator(schema)
    return validator


def validate(resource: Resource) -> None:
    if resource["apiVersion"].startswith("kafka.strimzi.io/"):
        strimzi_validator().validate(resource)
    else:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def resource_id(resource: Resource) -> str:
    return f"{resource['kind']}/{resource['metadata']['name']}"


# --- schemas ------------------------------------------------------------------------------

@pytest.mark.parametrize("resource", RESOURCES, ids=resource_id)
def test_resource_is_valid_against_its_schema(resource: Resource) -> None:
    validate(resource)


@pytest.mark.parametrize(("kind", "name", "path", "bad"), [
    ("Deployment", "driver", ("spec", "replicaz"), 3),
    ("StatefulSet", "processors", ("spec", "template", "spec", "containers", 0, "resources",
                                   "requestz"), {}),
    ("KafkaTopic", "dsh-inbox", ("spec", "partition"), 12),
    ("KafkaNodePool", "broker", ("spec", "roles", 0), "brokers"),
    ("Kafka", "dsh", ("spec", "kafka", "listeners", 0, "type"), "interal"),
])
def test_validation_rejects_a_misspelt_field(kind: str, name: str, path: tuple[Any, ...],
                                             bad: Any) -> None:
    broken = copy.deepcopy(named(kind, name))
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_kustomization_lists_every_manifest_and_nothing_else() -> None:
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert kustomization()["namespace"] == named("Namespace", "dsh")["metadata"]["name"]
    images = {i["name"] for i in kustomization()["images"]}
    assert {c["image"] for _, c in dsh_containers()} == images == {"dsh-pipeline"}


# --- topics (DESIGN.md section 2) ---------------------------------------------------------

def topic(name: str) -> dict[str, Any]:
    matches = [t["spec"] for t in of_kind("KafkaTopic") if t["spec"]["topicName"] == name]
    assert len(matches) == 1, f"expected one KafkaTopic for {name!r}"
    spec: dict[str, Any] = matches[0]
    return spec


def config_map() -> dict[str, str]:
    data: dict[str, str] = named("ConfigMap", "dsh-config")["data"]
    return data


def test_topics_are_the_projects_with_their_cleanup_policies() -> None:
    names = TopicNames(config_map()["DSH_TOPIC_PREFIX"])
    expected = {names.session_events, names.inbox, names.derived_messages, names.usage,
                names.fleet, names.spill, names.dlq(names.session_events),
                names.dlq(names.inbox), names.driver_checkpoints}
    assert {t["spec"]["topicName"] for t in of_kind("KafkaTopic")} == expected
    assert topic(names.driver_checkpoints)["config"]["cleanup.policy"] == "compact"
    events = topic(names.session_events)["config"]
    assert events["cleanup.policy"] == "delete", "session events must never be compacted"
    assert (events["retention.ms"], events["retention.bytes"]) == (-1, -1)
    for derived in (names.derived_messages, names.usage, names.fleet):
        assert topic(derived)["config"]["cleanup.policy"] == "compact"
    for dlq in (names.dlq(names.session_events), names.dlq(names.inbox), names.inbox):
        assert topic(dlq)["config"]["cleanup.policy"] == "delete"


def test_topics_are_what_the_services_ensure_at_start() -> None:
    """The services run ensure_topics at start and refuse a topic whose partitions or
    cleanup policy differ from their plan: the KafkaTopics must be exactly that plan."""
    for spec in plan_topics(Settings.from_env(config_map())):
        declared = topic(spec.name)
        assert declared["partitions"] == spec.partitions, spec.name
        assert declared["replicas"] == spec.replication_factor, spec.name
        for key, value in spec.configs.items():
            assert str(declared["config"][key]) == value, f"{spec.name}: {key}"


def test_inbox_and_session_events_are_co_partitioned_as_configured() -> None:
    names = TopicNames(config_map()["DSH_TOPIC_PREFIX"])
    settings = Settings.from_env(config_map())
    assert topic(names.inbox)["partitions"] == topic(names.session_events)["partitions"]
    assert topic(names.inbox)["partitions"] == settings.partitions
    for spec in (t["spec"] for t in of_kind("KafkaTopic")):
        assert spec["replicas"] == settings.replication_factor
        assert spec["config"]["min.insync.replicas"] < spec["replicas"]


def test_kafka_cluster_matches_the_settings() -> None:
    kafka = named("Kafka", "dsh")
    assert kafka["spec"]["kafka"]["version"].startswith("4.")
    pools = of_kind("KafkaNodePool")
    assert {p["metadata"]["labels"]["strimzi.io/cluster"] for p in pools} == {"dsh"}
    roles = {role for p in pools for role in p["spec"]["roles"]}
    assert roles == {"controller", "broker"}
    brokers = sum(p["spec"]["replicas"] for p in pools if "broker" in p["spec"]["roles"])
    assert brokers >= Settings.from_env(config_map()).replication_factor
    listeners = kafka["spec"]["kafka"]["listeners"]
    assert all(lst["tls"] and lst["authentication"]["type"] == "scram-sha-512"
               for lst in listeners), "every listener is TLS with SCRAM-SHA-512"
    bootstrap = f"{kafka['metadata']['name']}-kafka-bootstrap:{listeners[0]['port']}"
    settings = Settings.from_env(config_map())
    assert settings.bootstrap_servers == bootstrap
    assert (settings.security_protocol, settings.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
    assert kafka["spec"]["kafka"]["authorization"] == {"type": "simple", "superUsers": ["admin"]}
    assert "allow.everyone.if.no.acl.found" not in kafka["spec"]["kafka"]["config"]
    assert {t["metadata"]["labels"]["strimzi.io/cluster"] for t in of_kind("KafkaTopic")} == {
        "dsh"}


# --- settings, secrets, ports -------------------------------------------------------------

def env_vars(container: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = container.get("env", [])
    return found


def test_every_dsh_variable_is_a_setting_and_parses() -> None:
    assert set(config_map()) <= SETTINGS_VARS
    for workload, container in dsh_containers():
        names = {e["name"] for e in env_vars(container)}
        unknown = {n for n in names if n.startswith("DSH_")} - SETTINGS_VARS
        assert not unknown, f"{resource_id(workload)}: {sorted(unknown)} are not settings"
        literal = {e["name"]: e["value"] for e in env_vars(container) if "value" in e}
        Settings.from_env(config_map() | literal)
        assert container["envFrom"] == [{"configMapRef": {"name": "dsh-config"}}]


def test_secrets_come_only_by_reference() -> None:
    assert not of_kind("Secret"), "secret values must not live in the manifests"
    assert not set(config_map()) & SECRET_VARS
    for workload, container in dsh_containers():
        for env in env_vars(container):
            if env["name"] in SECRET_VARS or env["name"] == "DEEPSEEK_API_KEY":
                assert "value" not in env, f"{resource_id(workload)}: {env['name']} inline"
                ref = env["valueFrom"]["secretKeyRef"]
                # a Kafka password comes from the Secret Strimzi makes for the KafkaUser
                allowed = {"dsh-secrets"} | ({u["metadata"]["name"] for u in of_kind(
                    "KafkaUser")} if env["name"] == "DSH_SASL_PASSWORD" else set()) | (
                    {"registry-users"} if env["name"] == "DSH_REGISTRY_PASSWORD" else set())
                assert ref["name"] in allowed, f"{resource_id(workload)}: {env['name']}"


STRIMZI_RESOURCE_TYPE = {"topic": "topic", "group": "group",
                         "transactional-id": "transactionalId"}


def test_kafka_users_hold_exactly_the_acl_plan() -> None:
    """One KafkaUser per role, SCRAM-SHA-512, with the ACLs of acl_plan() for the ConfigMap's
    prefixes (the plan the secure local stack applies with kafka-acls)."""
    users = {u["metadata"]["name"]: u["spec"] for u in of_kind("KafkaUser")
             if u["metadata"]["name"] != "registry"}  # Apicurio's own journal user
    assert set(users) == set(ROLES)
    plan = acl_plan(Settings.from_env(config_map()))
    for role, spec in users.items():
        assert spec["authentication"] == {"type": "scram-sha-512"}
        expected = [{"resource": {"type": STRIMZI_RESOURCE_TYPE[r.resource], "name": r.name,
                                  "patternType": "prefix" if r.prefixed else "literal"},
                     "operations": list(r.operations)} for r in plan if r.principal == role]
        found = spec.get("authorization", {}).get("acls", [])
        assert found == expected, role


def test_every_dsh_pod_is_a_principal_trusting_the_cluster_ca() -> None:
    cafile = Path(Settings.from_env(config_map()).ssl_cafile)
    users = {u["metadata"]["name"] for u in of_kind("KafkaUser")}
    for workload, container in dsh_containers():
        env = {e["name"]: e for e in env_vars(container)}
        username = env["DSH_SASL_USERNAME"]["value"]
        assert username in users, resource_id(workload)
        ref = env["DSH_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (username, "password"), resource_id(workload)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert mounts["kafka-ca"] == str(cafile.parent), resource_id(workload)
        assert volumes["kafka-ca"]["secret"]["secretName"] == "dsh-cluster-ca-cert"
        assert volumes["kafka-ca"]["secret"]["items"] == [{"key": "ca.crt",
                                                           "path": cafile.name}]


def port_named(container: dict[str, Any], name: Any) -> int:
    if isinstance(name, int):
        return name
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return ports[name]


@pytest.mark.parametrize("workload_name", sorted(PORT_OF_WORKLOAD))
def test_probes_use_health_on_the_settings_port(workload_name: str) -> None:
    workload = next(w for w in workloads() if w["metadata"]["name"] == workload_name)
    (container,) = containers(workload)
    probes = [container[k] for k in ("livenessProbe", "readinessProbe", "startupProbe")
              if k in container]
    assert len(probes) >= 2
    for probe in probes:
        assert probe["httpGet"]["path"] == "/health"
        assert port_named(container, probe["httpGet"]["port"]) == PORT_OF_WORKLOAD[workload_name]
    assert container["args"][0] == workload_name


def test_every_container_has_requests_limits_and_runs_as_non_root() -> None:
    for workload in workloads():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, resource_id(workload)
        for container in containers(workload):
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), resource_id(workload)
            assert "memory" in resources["limits"], resource_id(workload)
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


# --- workloads, budgets, autoscaling ------------------------------------------------------

def selects(selector: dict[str, str], workload: Resource) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def test_services_and_budgets_select_their_pods() -> None:
    for kind in ("Deployment", "StatefulSet"):
        for workload in of_kind(kind):
            assert selects(workload["spec"]["selector"]["matchLabels"], workload)
            budgets = [b for b in of_kind("PodDisruptionBudget")
                       if selects(b["spec"]["selector"]["matchLabels"], workload)]
            assert len(budgets) == 1, f"{resource_id(workload)} needs one PodDisruptionBudget"
    for service in of_kind("Service"):
        assert any(selects(service["spec"]["selector"], w) for w in workloads())


def test_processors_keep_state_on_persistent_volumes() -> None:
    processors = named("StatefulSet", "processors")
    (container,) = containers(processors)
    state_dir = {e["name"]: e.get("value") for e in env_vars(container)}["DSH_STATE_DIR"]
    claims = {c["metadata"]["name"] for c in processors["spec"]["volumeClaimTemplates"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[state_dir] in claims
    headless = named("Service", processors["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"


def consumer_group(workload_name: str) -> str:
    """The group each service joins (cmd_driver: <prefix>driver; processors: the faust app id)."""
    settings = Settings.from_env(config_map())
    if workload_name == "processors":
        return ProcessorsOptions().app_id(settings)
    return f"{settings.group_id_prefix}{workload_name}"


@pytest.mark.parametrize(("workload_kind", "name", "source_topic"), [
    ("Deployment", "driver", "inbox"),
    ("StatefulSet", "processors", "session_events"),
])
def test_autoscaling_follows_consumer_lag_within_the_partitions(
        workload_kind: str, name: str, source_topic: str) -> None:
    hpa = named("HorizontalPodAutoscaler", name)
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (workload_kind, name)
    named(workload_kind, name)
    topic_name = getattr(TopicNames(config_map()["DSH_TOPIC_PREFIX"]), source_topic)
    (metric,) = hpa["spec"]["metrics"]
    selector = metric["external"]["metric"]["selector"]["matchLabels"]
    assert metric["external"]["metric"]["name"] == "kafka_consumergroup_lag"
    assert selector["topic"] == topic_name
    assert selector["consumergroup"] == consumer_group(name)
    partitions = topic(topic_name)["partitions"]
    assert "replicas" not in named(workload_kind, name)["spec"], (
        "the autoscaler owns the count: a fixed one is reset at every apply")
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert hpa["spec"]["maxReplicas"] <= partitions, "replicas past the partitions sit idle"


@functools.cache
def cli_commands() -> dict[str, Any]:
    action = next(a for a in build_parser()._actions
                  if isinstance(a.choices, dict) and "config" in a.choices)
    choices: dict[str, Any] = action.choices
    return choices


@pytest.mark.parametrize("workload", [w for w, _ in dsh_containers()], ids=resource_id)
def test_container_args_are_a_valid_command_line(workload: Resource) -> None:
    (container,) = containers(workload)
    defined = {e["name"] for e in env_vars(container)}
    args = list(container["args"])
    for i, arg in enumerate(args):
        for name in defined:
            arg = arg.replace(f"$({name})", "10.0.0.7")
        assert "$(" not in arg, f"{resource_id(workload)}: {arg!r} names an undefined variable"
        args[i] = arg
    if args[0] not in cli_commands():
        pytest.skip(f"`dsh-pipeline {args[0]}` is not built yet")
    cli_commands()[args[0]].parse_args(args[1:])


def test_processors_bind_where_probes_and_other_workers_reach_them() -> None:
    (container,) = containers(named("StatefulSet", "processors"))
    args = container["args"]
    assert args[args.index("--web-host") + 1] == "$(POD_IP)"
    pod_ip = next(e for e in env_vars(container) if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert args[args.index("--store") + 1] == "rocksdb://"


def test_the_dashboard_asks_the_processors_service_on_its_web_port() -> None:
    (dashboard,) = containers(named("Deployment", "dashboard"))
    url = next(e["value"] for e in env_vars(dashboard)
               if e["name"] == "DSH_DASHBOARD_PROCESSORS_URL")
    (processors,) = containers(named("StatefulSet", "processors"))
    service = named("Service", "processors")
    assert url == f"http://{service['metadata']['name']}:{port_named(processors, 'web')}"
    assert any(p["port"] == port_named(processors, "web") for p in service["spec"]["ports"])


def test_registry_probes_use_apicurios_management_port() -> None:
    (container,) = containers(named("Deployment", "registry"))
    env = {e["name"]: e.get("value") for e in env_vars(container)}
    assert env["APICURIO_STORAGE_KIND"] == "kafkasql", "in-memory schemas die with the pod"
    assert env["APICURIO_KAFKASQL_BOOTSTRAP_SERVERS"] == config_map()["DSH_BOOTSTRAP_SERVERS"]
    assert env["APICURIO_KAFKA_COMMON_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert env["APICURIO_KAFKA_COMMON_SSL_TRUSTSTORE_LOCATION"] == config_map()["DSH_SSL_CAFILE"]
    for key in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[key]["httpGet"]
        assert probe["path"].startswith("/health/")
        assert port_named(container, probe["port"]) == 9000
    service_port = named("Service", "registry")["spec"]["ports"][0]["port"]
    assert config_map()["DSH_REGISTRY_URL"] == (
        f"https://registry:{service_port}/apis/ccompat/v7")


def test_the_registry_serves_https_with_basic_auth_as_the_local_secure_stack() -> None:
    """The registry's Quarkus settings are those the secure local stack runs
    (secure_registry_properties), its certificate from the Secret registry-tls, and one
    embedded user per principal with the local stack's role, the password by reference."""
    registry = named("Deployment", "registry")
    (container,) = containers(registry)
    env = {e["name"]: e for e in env_vars(container)}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    folder = mounts["registry-tls"]
    https = port_named(container, "https")
    expected = secure_registry_properties(f"{folder}/tls.crt", f"{folder}/tls.key", https)
    for prop, value in expected.items():
        assert env[quarkus_env_name(prop)].get("value") == value, prop
    volumes = {v["name"]: v for v in registry["spec"]["template"]["spec"]["volumes"]}
    assert volumes["registry-tls"]["secret"]["secretName"] == "registry-tls"
    assert {i["key"] for i in volumes["registry-tls"]["secret"]["items"]} == {"tls.crt",
                                                                              "tls.key"}
    for role in ROLES:
        user = env[f"{EMBEDDED_USERS_ENV}_{role.upper()}"]
        assert "value" not in user, role
        assert user["valueFrom"]["secretKeyRef"] == {"name": "registry-users", "key": role}
        assert env[f"{EMBEDDED_ROLES_ENV}_{role.upper()}"]["value"] == registry_role(role)
    assert named("Service", "registry")["spec"]["ports"][0]["targetPort"] == "https"
    assert "http" not in {p["name"] for p in container["ports"]}, "a plain HTTP API port"


def test_every_dsh_pod_reads_the_registry_as_its_principal() -> None:
    users = set(ROLES)
    for workload, container in dsh_containers():
        env = {e["name"]: e for e in env_vars(container)}
        username = env["DSH_REGISTRY_USERNAME"]["value"]
        assert username == env["DSH_SASL_USERNAME"]["value"] and username in users
        assert env["DSH_REGISTRY_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "registry-users", "key": username}, resource_id(workload)


def test_the_driver_pod_outlives_its_shutdown_grace() -> None:
    driver = named("Deployment", "driver")
    (container,) = containers(driver)
    if "driver" not in cli_commands():
        pytest.skip("`dsh-pipeline driver` is not built yet")
    grace = cli_commands()["driver"].parse_args(container["args"][1:]).grace
    # the driver's grace for running turns, then closing transactions and leaving the group
    assert grace + 15 <= driver["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert driver["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
