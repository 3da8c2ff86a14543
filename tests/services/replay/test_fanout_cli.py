"""The fan-out commands as a user runs them: ``import`` twice (nothing new the second time),
``export``, and ``tail`` as a process whose piped output is plain text."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fanout_support import FIXTURES, fanout_settings, publish

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.cli.main import main
from pipeline.codec.sessionfile import read_session_file
from pipeline.settings import Settings


def _env(settings: Settings) -> dict[str, str]:
    return {"DSH_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "DSH_TOPIC_PREFIX": settings.topic_prefix, "DSH_PARTITIONS": "3",
            "DSH_GROUP_ID_PREFIX": settings.group_id_prefix}


@pytest.mark.broker
def test_import_twice_then_export(kafka_bootstrap: str, topic_prefix: str, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    for name, value in _env(settings).items():
        monkeypatch.setenv(name, value)
    source = FIXTURES / "cancel.jsonl"
    events = len(read_session_file(source).events)
    for published in (events, 0):
        assert main(["import", str(source), "--session-id", "c1"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert (result["session"], result["published"], result["events"]) == (
            "c1", published, events)
    out = tmp_path / "c1.jsonl"
    assert main(["export", "c1", "-o", str(out)]) == 0
    assert out.read_bytes() == source.read_bytes()
    assert main(["import", str(source), str(source), "--session-id", "x"]) == 2  # one file only
    assert "give one FILE" in capsys.readouterr().err


@pytest.mark.broker
def test_tail_streams_a_plain_readable_view(kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    events = read_session_file(FIXTURES / "text-turn.jsonl").events
    asyncio.run(ensure_topics(settings))
    asyncio.run(publish(settings, "t1", events))
    tail = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "tail", "t1",
                             "--from-beginning"], env={**os.environ, **_env(settings)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(60.0, tail.kill)  # a hang becomes a failure, not a stuck suite
    guard.start()
    try:
        assert tail.stdout is not None
        lines: list[str] = []
        while not lines or not lines[-1].startswith("■ turn 1"):
            line = tail.stdout.readline()
            assert line, tail.stderr.read() if tail.stderr else "tail ended"
            lines.append(line.rstrip("\n"))
    finally:
        guard.cancel()
        tail.terminate()
        tail.wait(timeout=30)
    text = "\n".join(lines)
    assert "\x1b[" not in text  # piped: no colours
    assert "▶ turn 1" in text and "  step 1" in text
    assert "    assistant: PONG" in text  # assembled from the streamed text deltas
    assert lines[-1] == "■ turn 1 completed"


@pytest.mark.broker
def test_commands_on_a_prefix_without_topics_say_so(kafka_bootstrap: str, topic_prefix: str,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    for name, value in _env(settings).items():
        monkeypatch.setenv(name, value)
    assert main(["replay"]) == 1  # a failed check, not a usage error
    assert f"topic '{topic_prefix}session-events' does not exist" in capsys.readouterr().err
    assert main(["export", "nobody", "-o", "/dev/null"]) == 1
    assert "does not exist" in capsys.readouterr().err
