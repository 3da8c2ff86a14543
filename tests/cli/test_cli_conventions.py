"""One CLI convention: every command and argument described, defaults shown, ``--version``,
the top-level summaries equal to the commands' own, file commands that load no Kafka, faust
or aiohttp code, durations with units, and a completion script generated from the parser."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import main as cli_main
from pipeline.cli.common import parse_duration, parse_duration_ms
from pipeline.cli.main import build_parser, commands

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "sessions" / "text-turns.jsonl"
NETWORK_MODULES = ("aiokafka", "faust", "mode", "aiohttp", "httpx")


def subcommands(parser: argparse.ArgumentParser, path: str = ""
                ) -> list[tuple[str, argparse.ArgumentParser, str | None]]:
    """(``command [action]``, its parser, its help in the parent's list), depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                full = f"{path} {name}".strip()
                found.append((full, child, helps.get(name)))
                found.extend(subcommands(child, full))
    return found


def test_every_command_and_argument_is_described() -> None:
    found = subcommands(build_parser())
    assert len(found) >= len(commands())
    for name, parser, summary in found:
        assert summary, f"{name}: no help in the command list"
        assert parser.description, f"{name}: no description"
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help"


def test_defaults_show_in_help() -> None:
    driver = next(p for n, p, _ in subcommands(build_parser("driver")) if n == "driver")
    text = driver.format_help()
    assert "(default: 25ms)" in text and "(default: 10s)" in text and "(default: 256)" in text


def test_the_top_level_list_is_every_command_with_its_own_summary() -> None:
    full = {name: summary for name, _, summary in subcommands(build_parser())
            if " " not in name}
    assert set(full) == set(commands()), \
        "add new commands to PRODUCT_COMMANDS in pipeline/cli/main.py"
    for name, (module, summary) in commands().items():
        assert full[name] == summary, name
        alone = {n for n, _, _ in subcommands(build_parser(name)) if " " not in n}
        assert name in alone, f"{module} does not register {name}"


def test_version_and_help_need_no_settings() -> None:
    env = {"PATH": "/usr/bin:/bin", "DSH_PARTITIONS": "many"}
    version = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "--version"],
                             capture_output=True, text=True, cwd=ROOT, env=env)
    assert version.returncode == 0
    assert version.stdout.startswith("dsh-pipeline ") and version.stdout.split()[1][0].isdigit()
    top = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "--help"],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert top.returncode == 0 and all(name in top.stdout for name in commands())


@pytest.mark.parametrize("argv", [
    ["validate", str(SAMPLE)], ["derive", "--json", str(SAMPLE)],
    ["encode", str(SAMPLE), "-o", "-"], ["schemas", "list"], ["config"], ["--help"],
    ["tail", "--help"]], ids=lambda argv: " ".join(argv[:1]))
def test_file_commands_load_no_network_code(argv: list[str]) -> None:
    """Only the command's own module is imported: a file command starts in ~0.1 s instead of
    ~1.2 s (measured: docs/cli.md), and `tail --help` parses without connecting."""
    probe = ("import sys\nfrom pipeline.cli.main import main\ncode = main(sys.argv[1:])\n"
             "loaded = {m.split('.')[0] for m in sys.modules}\n"
             f"loaded = sorted(loaded & {set(NETWORK_MODULES)!r})\n"
             "print('LOADED', code, ','.join(loaded), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True,
                          cwd=ROOT, timeout=60)
    stderr = done.stderr.decode()
    report = stderr.strip().splitlines()[-1].split(" ")
    assert report[:2] == ["LOADED", "0"], stderr
    loaded = report[2] if len(report) > 2 else ""
    if argv[0] == "tail":
        assert "aiokafka" in loaded  # a command that uses Kafka does load it
    else:
        assert loaded == "", f"{argv[0]} loaded {loaded}"


def test_durations_take_units() -> None:
    assert [parse_duration(t) for t in ("500ms", "30s", "5m", "1h", "2d", "1.5", "2.5s")] == [
        0.5, 30.0, 300.0, 3600.0, 172800.0, 1.5, 2.5]
    assert parse_duration_ms("25ms") == 25
    for bad in ("soon", "5x", "-1s", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration(bad)
    assert cli_main.main(["check", "--open-turn-max-age", "soon"]) == 2
    args = build_parser("driver").parse_args(["driver", "--linger", "40ms", "--grace", "1m"])
    assert (args.linger_ms, args.grace) == (40, 60.0)
    old = build_parser("driver").parse_args(["driver", "--linger-ms", "40", "--metrics-port",
                                             "-1"])  # the old spellings still work
    assert (old.linger_ms, old.port) == (40.0, -1)


def _complete(script: str, *words: str) -> list[str]:
    line = " ".join(words)
    program = (f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}\n"
               "_dsh_pipeline; printf '%s\\n' \"${COMPREPLY[@]}\"\n")
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_bash_completion_is_generated_from_the_parser() -> None:
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "completion", "bash"],
                          capture_output=True, text=True, cwd=ROOT, check=True)
    script = done.stdout
    assert _complete(script, "dsh-pipeline", "sch") == ["schemas"]
    assert _complete(script, "dsh-pipeline", "schemas", "ch") == ["check"]
    assert "--from-beginning" in _complete(script, "dsh-pipeline", "tail", "--fr")
    assert "--allow-torn-tail" in _complete(script, "dsh-pipeline", "validate", "--")
    zsh = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "completion", "zsh"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert zsh.startswith("#compdef dsh-pipeline") and "bashcompinit" in zsh


@pytest.mark.broker
def test_a_service_logs_json_lines(kafka_bootstrap: str, topic_prefix: str,
                                   tmp_path: Path) -> None:
    """``driver --log-format json``: every log record on stderr is one JSON object."""
    import json
    import os
    import signal

    env = {**os.environ, "DSH_BOOTSTRAP_SERVERS": kafka_bootstrap,
           "DSH_TOPIC_PREFIX": topic_prefix, "DSH_PARTITIONS": "3",
           "DSH_GROUP_ID_PREFIX": f"{topic_prefix}g-"}
    log = tmp_path / "stderr.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "driver", "--port",
                                 "-1", "--log-format", "json", "--log-level", "debug"],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT,
                                env=env)
        assert proc.stdout is not None
        try:
            ready = proc.stdout.readline()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
    lines = log.read_text().splitlines()
    assert ready.startswith("ready group="), "\n".join(lines[-20:])
    records = [json.loads(line) for line in lines if line.strip()]
    assert records, "no log record at debug level"
    for record in records:
        assert {"time", "level", "logger", "message"} <= set(record), record
    assert {"debug", "info"} <= {record["level"] for record in records}
