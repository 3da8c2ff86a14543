"""``dsh-pipeline schemas``: the offline BACKWARD_TRANSITIVE check gives the registry's verdict.

Each candidate is checked offline and then registered, after every committed version of its
schema, under a fresh subject of the real registry with BACKWARD_TRANSITIVE: the registry
accepts exactly the candidates the offline check passes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.adapters.registry.client import BACKWARD_TRANSITIVE, RegistryClient
from pipeline.codec.compatibility import backward_transitive, read_problems
from pipeline.core.errors import RegistryError

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "schemas"
NAMES = sorted(p.name.removesuffix(".avsc") for p in SCHEMAS.glob("*.avsc"))


def load(path: Path) -> Any:
    return json.loads(path.read_text())


def history(name: str) -> list[Any]:
    paths = sorted(SCHEMAS.glob(f"history/{name}.v*.avsc"),
                   key=lambda p: int(p.name.removesuffix(".avsc").rsplit(".v", 1)[1]))
    return [load(p) for p in paths]


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli.main", "schemas", *args],
                          input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=60)


def add_field(default: bool) -> Callable[[Any], Any]:
    def change(schema: Any) -> Any:
        field: dict[str, Any] = {"name": "addedLater", "type": ["null", "string"]}
        if default:
            field["default"] = None
        schema["fields"].append(field)
        return schema
    return change


def drop_first_field(schema: Any) -> Any:
    schema["fields"].pop(0)
    return schema


def narrow_long_fields(schema: Any) -> Any:
    for field in schema["fields"]:
        if field["type"] == "long":
            field["type"] = "int"
    return schema


def widen_int_fields(schema: Any) -> Any:
    for field in schema["fields"]:
        if field["type"] == "int":
            field["type"] = "long"
    return schema


def rename_record(schema: Any) -> Any:
    schema["name"] = schema["name"] + "Renamed"
    return schema


CHANGES = {"field with default": add_field(True), "field without default": add_field(False),
           "field dropped": drop_first_field, "long to int": narrow_long_fields,
           "int to long": widen_int_fields, "record renamed": rename_record}


def test_todays_schemas_pass_against_their_history() -> None:
    for name in NAMES:
        results = backward_transitive(load(SCHEMAS / f"{name}.avsc"),
                                      [(str(i), s) for i, s in enumerate(history(name))])
        assert results and not any(results.values()), (name, results)
    listed = cli("list")
    assert listed.returncode == 0 and all(name in listed.stdout for name in NAMES)
    shown = cli("show", "dsh.SessionEvent", "--version", "1")
    assert json.loads(shown.stdout) == history("dsh.SessionEvent")[0]
    assert cli("show", "dsh.Nothing").returncode == 1


def test_the_command_reports_each_problem_and_exits_1(tmp_path: Path) -> None:
    schema = add_field(False)(load(SCHEMAS / "dsh.FleetStatus.avsc"))
    bad = cli("check", "-", stdin=json.dumps(schema))
    assert bad.returncode == 1
    assert "FleetStatus.addedLater: a new field without a default" in bad.stdout
    assert "NOT compatible" in bad.stdout
    good = cli("check", str(SCHEMAS / "dsh.SessionEvent.avsc"))
    assert good.returncode == 0 and "v1: ok" in good.stdout and "v2: ok" in good.stdout
    assert cli("check", "-", stdin="{not json").returncode == 1


def test_unions_enums_and_promotions() -> None:
    enum_v1 = {"type": "enum", "name": "E", "symbols": ["A", "B"]}
    assert read_problems({**enum_v1, "symbols": ["A", "B", "C"]}, enum_v1) == []
    assert read_problems({**enum_v1, "symbols": ["A"]}, enum_v1)
    assert read_problems({**enum_v1, "symbols": ["A"], "default": "A"}, enum_v1) == []
    assert read_problems(["null", "long"], "int") == []
    assert read_problems("int", ["null", "int"])  # the writer's null has nowhere to go
    assert read_problems({"type": "array", "items": "double"},
                         {"type": "array", "items": "float"}) == []
    assert read_problems({"type": "map", "values": "int"}, {"type": "map", "values": "long"})


@pytest.mark.registry
@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("name", ["dsh.FleetStatus", "dsh.UsageRecord"])
def test_the_offline_verdict_is_the_registrys(registry_url: str, name: str, change: str) -> None:
    candidate = CHANGES[change](copy.deepcopy(load(SCHEMAS / f"{name}.avsc")))
    offline = not any(backward_transitive(
        candidate, [(str(i), s) for i, s in enumerate(history(name))]).values())
    subject = f"compat-{uuid.uuid4().hex[:10]}-value"
    with RegistryClient(registry_url) as client:
        for version in history(name):
            client.register(subject, json.dumps(version))
        client.set_compatibility(BACKWARD_TRANSITIVE, subject)
        try:
            client.register(subject, json.dumps(candidate))
            accepted = True
        except RegistryError:
            accepted = False
    assert offline == accepted, f"{name}, {change}: offline {offline}, registry {accepted}"
