"""``tail`` and ``export`` with the options users know from kcat and friends, against the real
broker: formats, type filters, where to start, ``-c``, ``-e``, colour only on a terminal."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from fanout_support import fanout_settings, publish

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.events import Event
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples" / "sessions"
SESSIONS = ("text-turns", "cancel")

pytestmark = pytest.mark.broker


@pytest.fixture
def published(kafka_bootstrap: str, topic_prefix: str) -> tuple[Settings, dict[str, list[Event]]]:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    asyncio.run(ensure_topics(settings))
    events = {name: list(read_session_file(SAMPLES / f"{name}.jsonl").events)
              for name in SESSIONS}
    for name, session in events.items():
        asyncio.run(publish(settings, name, session))
    return settings, events


def run(settings: Settings, *args: str, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "DSH_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
                   "DSH_TOPIC_PREFIX": settings.topic_prefix, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pipeline.cli.main", *args], cwd=ROOT,
                          env=environment, capture_output=True, text=True, timeout=120)


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def test_json_from_the_beginning_to_the_end(published: tuple[Settings, dict[str, list[Event]]]
                                            ) -> None:
    settings, events = published
    done = run(settings, "tail", "--from-beginning", "-e", "--format", "json")
    assert done.returncode == 0, done.stderr
    rows = json_lines(done.stdout)
    for name, session in events.items():
        mine = [row["event"] for row in rows if row["session"] == name]
        assert mine == [event.to_json() for event in session]
    assert {"partition", "offset", "timestamp"} <= set(rows[0])


def test_one_session_from_a_seq_of_some_types(
        published: tuple[Settings, dict[str, list[Event]]]) -> None:
    settings, events = published
    done = run(settings, "tail", "cancel", "--from-seq", "10", "-e", "--format", "json",
               "--type", "turn/start,turn/end", "--type", "assistant/message")
    assert done.returncode == 0, done.stderr
    got = [(row["session"], row["event"]["seq"]) for row in json_lines(done.stdout)]
    wanted = [("cancel", e.seq) for e in events["cancel"] if e.seq >= 10
              and e.type in ("turn/start", "turn/end", "assistant/message")]
    assert got == wanted and len(wanted) >= 3


def test_count_stops_and_time_starts(published: tuple[Settings, dict[str, list[Event]]]
                                     ) -> None:
    settings, _ = published
    counted = run(settings, "tail", "--from-beginning", "-c", "3", "--format", "json")
    assert counted.returncode == 0 and len(json_lines(counted.stdout)) == 3
    recent = run(settings, "tail", "--from-time", "1h", "-e", "--format", "json")
    assert recent.returncode == 0 and len(json_lines(recent.stdout)) > 0
    future = run(settings, "tail", "--from-time", "2099-01-01T00:00:00Z", "-e")
    assert future.returncode == 0 and future.stdout == ""
    usage = run(settings, "tail", "--from-seq", "3")
    assert usage.returncode == 2 and "needs a SESSION" in usage.stderr


def _on_a_terminal(settings: Settings, env: dict[str, str]) -> bytes:
    """tail's stdout on a pseudo-terminal."""
    controller, terminal = pty.openpty()
    environment = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    environment.update(DSH_BOOTSTRAP_SERVERS=settings.bootstrap_servers,
                       DSH_TOPIC_PREFIX=settings.topic_prefix, **env)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "tail", "text-turns",
                             "--from-beginning", "-e"], cwd=ROOT, env=environment,
                            stdout=terminal, stderr=subprocess.PIPE)
    os.close(terminal)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: tail ended
            break
        if not chunk:
            break
        output += chunk
    assert proc.wait(timeout=120) == 0
    os.close(controller)
    return output


def test_colour_only_on_a_terminal_and_never_with_no_color(
        published: tuple[Settings, dict[str, list[Event]]]) -> None:
    settings, _ = published
    assert b"\x1b[" in _on_a_terminal(settings, {})
    plain = _on_a_terminal(settings, {"NO_COLOR": "1"})
    assert b"turn 1" in plain and b"\x1b[" not in plain
    piped = run(settings, "tail", "text-turns", "--from-beginning", "-e")
    assert "turn 1" in piped.stdout and "\x1b[" not in piped.stdout


def test_export_a_range_to_stdout(published: tuple[Settings, dict[str, list[Event]]]
                                  ) -> None:
    settings, _ = published
    done = run(settings, "export", "cancel", "--from-seq", "5", "--to-seq", "9", "--unpacked",
               "-o", "-")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert json.loads(lines[0])["id"] == "cancel"  # the header line first
    assert [json.loads(line)["seq"] for line in lines[1:]] == [5, 6, 7, 8, 9]
    whole = run(settings, "export", "cancel")  # stdout by default, the whole session
    assert whole.stdout == (SAMPLES / "cancel.jsonl").read_text()
    bad = run(settings, "export", "cancel", "--from-seq", "9", "--to-seq", "5")
    assert bad.returncode == 2
