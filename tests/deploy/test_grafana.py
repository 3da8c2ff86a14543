"""deploy/grafana/: the alert rules and scrape configs checked by promtool (``check rules``,
``test rules``, ``check config``), the dashboard loaded by Grafana's own models
(grafana-foundation-sdk) with nothing dropped, and every metric the rules and panels name
exported by a service of the project."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.adapters.llm.scripted import echo_script
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.avro import EventSerde
from pipeline.services.dashboard.model import DashboardMetrics
from pipeline.services.driver.http_status import SnapshotCollector
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.tools import builtin_registry
from pipeline.services.otel.metrics import OtelMetrics
from pipeline.services.processors.app import build_processors
from pipeline.services.processors.metrics import processors_metrics_text
from pipeline.settings import Settings

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dsh-pipeline-dashboard.json"
PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right",
                          "and", "or", "unless", "bool", "offset", "le", "inf", "nan"})


def promtool(*args: str, cwd: Path = GRAFANA) -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is missing: `make promtool` installs Debian's prometheus package")
    done = subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.promtool
def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    assert "SUCCESS: 8 rules found" in promtool("check", "rules", "alerts.yml")
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")
    names = {r["alert"] for g in yaml.safe_load((GRAFANA / "alerts.yml").read_text())["groups"]
             for r in g["rules"]}
    tested = {t["alertname"] for case in yaml.safe_load(
        (GRAFANA / "alerts_test.yml").read_text())["tests"] for t in case["alert_rule_test"]}
    assert names == tested  # every alert has a test that makes it fire


@pytest.mark.promtool
def test_scrape_configs_pass_promtool_check_config() -> None:
    promtool("check", "config", "prometheus.yml")
    # Debian's promtool is built without Kubernetes discovery: the pod discovery block is
    # checked by name here, the rest (relabelling, rules) by promtool on a copy with a
    # static target in its place
    config = yaml.safe_load((GRAFANA / "prometheus-kubernetes.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod", "namespaces": {"names": ["dsh"]}}]
    job["static_configs"] = [{"targets": ["pod:9464"]}]
    with tempfile.TemporaryDirectory() as folder:
        shutil.copy(GRAFANA / "alerts.yml", folder)
        Path(folder, "prometheus.yml").write_text(yaml.safe_dump(config))
        promtool("check", "config", "prometheus.yml", cwd=Path(folder))


def _lost_keys(written: Any, loaded: Any, path: str = "") -> list[str]:
    """Keys of ``written`` that did not survive Grafana's model (unknown to its schema)."""
    if isinstance(written, dict):
        if not isinstance(loaded, dict):
            return [path]
        return [lost for key, value in written.items()
                for lost in ([f"{path}/{key}"] if key not in loaded
                             else _lost_keys(value, loaded[key], f"{path}/{key}"))]
    if isinstance(written, list):
        if not isinstance(loaded, list) or len(loaded) != len(written):
            return [path]
        return [lost for i, (a, b) in enumerate(zip(written, loaded, strict=True))
                for lost in _lost_keys(a, b, f"{path}[{i}]")]
    return []


def grafana_round_trip(document: dict[str, Any]) -> Any:
    register_default_plugins()
    model = Dashboard.from_json(document)
    return json.loads(json.dumps(model.to_json(), default=lambda o: o.to_json()))


def test_dashboard_loads_in_grafanas_model_without_losing_anything() -> None:
    document = json.loads(DASHBOARD.read_text())
    assert _lost_keys(document, grafana_round_trip(document)) == []
    kinds = {p["type"] for p in document["panels"]}
    assert kinds == {"row", "stat", "timeseries"}
    typo = json.loads(DASHBOARD.read_text())
    typo["panels"][1]["titel"] = typo["panels"][1].pop("title")
    assert _lost_keys(typo, grafana_round_trip(typo)) == ["/panels[1]/titel"]
    for panel in document["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
    wanted = {"Fleet", "Turns, steps and tokens", "Consumers and dead letters", "Providers"}
    assert wanted <= {p["title"] for p in document["panels"] if p["type"] == "row"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not functions, keywords or labels)."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    found = re.findall(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", text)
    return {name for name in found if name.lower() not in PROMQL_WORDS}


def _names_of(text: str) -> set[str]:
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        base = family.name
        names |= {"counter": {f"{base}_total"}, "histogram": {
            f"{base}_bucket", f"{base}_count", f"{base}_sum"}}.get(family.type, {base})
        names |= {s.name for s in family.samples}
    return names


def exported_metrics(tmp: Path) -> set[str]:
    driver = DriverService(driver_context(Settings(), group_id="g", tools=builtin_registry(),
                                          script=echo_script), DriverConfig())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(driver.metrics_snapshot))
    texts = [generate_latest(registry).decode(), driver.metrics.runner.render(),
             OtelMetrics().registry_text(), DashboardMetrics().render().decode()]
    processors = build_processors(Settings(state_dir=str(tmp)), EventSerde().decode)
    texts.append(processors_metrics_text(processors))
    return set().union(*(_names_of(t) for t in texts)) | {"up"}


def test_every_metric_the_rules_and_panels_name_is_exported(tmp_path: Path) -> None:
    exprs = [r["expr"] for g in yaml.safe_load((GRAFANA / "alerts.yml").read_text())["groups"]
             for r in g["rules"]]
    exprs += [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
              for t in p.get("targets", ())]
    named = set().union(*(metric_names(e) for e in exprs))
    assert {"dsh_driver_turns_total", "gen_ai_client_token_usage_sum",
            "dsh_dashboard_consumer_lag_seconds", "dsh_processors_in_recovery"} <= named
    assert metric_names("sum by (kind) (rate(x_total{a=\"b\"}[5m])) > 0.2 or absent(up)") == {
        "x_total", "up"}
    missing = named - exported_metrics(tmp_path)
    assert not missing, f"named by deploy/grafana but exported by no service: {sorted(missing)}"
