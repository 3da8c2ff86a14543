"""``dsh-pipeline config`` and the configuration reference in deploy/README.md."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from pipeline.cli import cmd_config
from pipeline.cli.main import main
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "deploy" / "README.md"
BEGIN = re.compile(r"<!-- BEGIN config reference[^\n]*-->\n")
END = "<!-- END config reference -->"
SECRET_VALUES = {
    "DSH_SASL_PASSWORD": "sasl-pw-7f3a9",
    "DSH_REGISTRY_PASSWORD": "registry-pw-91bd2",
    "DSH_DASHBOARD_TOKEN": "dash-token-c0ffee",
    "DEEPSEEK_API_KEY": "sk-deepseek-5e5e5e",
}


def clear_dsh_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for f in fields(Settings):
        monkeypatch.delenv(f"DSH_{f.name.upper()}", raising=False)
    monkeypatch.delenv("DEEPSEEK_API_KEY", raising=False)


def run_config(capsys: pytest.CaptureFixture[str],
               *args: str) -> str:
    assert main(["config", *args]) == 0
    return capsys.readouterr().out


def guide_reference() -> str:
    text = GUIDE.read_text(encoding="utf-8")
    begin = BEGIN.search(text)
    assert begin, f"{GUIDE}: no '<!-- BEGIN config reference ... -->' marker"
    end = text.index(END, begin.end())
    return text[begin.end():end]


def test_the_guide_reference_is_up_to_date() -> None:
    expected = cmd_config.render_markdown(cmd_config.setting_rows(Settings()))
    assert guide_reference() == expected, (
        "deploy/README.md's configuration reference is stale: replace the lines between the "
        "BEGIN/END config reference markers with the output of `dsh-pipeline config --markdown`")


def test_every_setting_is_described() -> None:
    missing = [f.name for f in fields(Settings) if f.name not in cmd_config.DESCRIPTIONS]
    assert not missing, f"add a line to DESCRIPTIONS in pipeline/cli/cmd_config.py: {missing}"
    assert set(cmd_config.DESCRIPTIONS) <= {f.name for f in fields(Settings)}


def test_table_lists_every_variable_with_default_and_current(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    clear_dsh_env(monkeypatch)
    monkeypatch.setenv("DSH_PARTITIONS", "24")
    out = run_config(capsys)
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert set(lines) == {f"DSH_{f.name.upper()}" for f in fields(Settings)}
    assert lines["DSH_PARTITIONS"] == ["6", "24"]
    assert lines["DSH_TOPIC_PREFIX"] == ["dsh.", "dsh."]


def test_markdown_does_not_depend_on_the_environment(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    clear_dsh_env(monkeypatch)
    plain = run_config(capsys, "--markdown")
    monkeypatch.setenv("DSH_PARTITIONS", "24")
    monkeypatch.setenv("DSH_BOOTSTRAP_SERVERS", "kafka:9092")
    assert run_config(capsys, "--markdown") == plain
    assert plain.splitlines()[0] == cmd_config.REFERENCE_HEADER


def test_env_output_reads_back_to_the_same_settings(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    clear_dsh_env(monkeypatch)
    monkeypatch.setenv("DSH_PARTITIONS", "12")
    monkeypatch.setenv("DSH_TOPIC_PREFIX", "prod.")
    out = run_config(capsys, "--env")
    env = dict(line.split("=", 1) for line in out.splitlines() if not line.startswith("#"))
    assert Settings.from_env(env) == Settings.from_env(
        {"DSH_PARTITIONS": "12", "DSH_TOPIC_PREFIX": "prod."})


@pytest.mark.parametrize("mode", [(), ("--env",), ("--markdown",)])
def test_secret_values_never_appear(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str],
                                    mode: tuple[str, ...]) -> None:
    clear_dsh_env(monkeypatch)
    for name, value in SECRET_VALUES.items():
        monkeypatch.setenv(name, value)
    out = run_config(capsys, *mode)
    for value in SECRET_VALUES.values():
        assert value not in out
    if mode == ("--env",):
        assert "# DSH_SASL_PASSWORD=********" in out
        assert "# DSH_DEEPSEEK_API_KEY=********" in out


def test_markdown_and_env_are_exclusive() -> None:
    result = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "config", "--env",
                             "--markdown"], capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    assert result.returncode == 2
    assert "not allowed with" in result.stderr


def test_a_bad_value_is_named(monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    clear_dsh_env(monkeypatch)
    monkeypatch.setenv("DSH_DASHBOARD_PORT", "eighty")
    assert main(["config"]) == 2
    assert "DSH_DASHBOARD_PORT must be an integer" in capsys.readouterr().err
