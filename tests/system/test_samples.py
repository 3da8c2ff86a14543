"""The repository's own sample sessions: what the recorder writes today, valid, and enough
for the demo of a plain clone (no ``shared/`` beside it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.codec.sessionfile import load_session

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples" / "sessions"
KINDS = {"text-turns": "assistant/message", "tool-calls": "tool/result",
         "cancel": "turn/end", "steer": "agent/inbox/spliced", "retry": "llm/retry",
         "compaction": "compaction/end"}


def test_the_samples_are_what_the_recorder_writes(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "bench" / "record_samples.py"),
                    "--out", str(tmp_path)], check=True, capture_output=True, cwd=ROOT)
    recorded = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert recorded == sorted(p.name for p in SAMPLES.glob("*.jsonl"))
    for name in recorded:
        assert (tmp_path / name).read_bytes() == (SAMPLES / name).read_bytes(), name


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_sample_is_strictly_valid_and_shows_its_case(name: str) -> None:
    _, log = load_session(SAMPLES / f"{name}.jsonl", mode="strict")
    types = [event.type for event in log.events]
    assert KINDS[name] in types
    if name == "cancel":
        ends = [e.data for e in log.events if e.type == "turn/end"]
        assert isinstance(ends[0], dict) and ends[0]["reason"]["kind"] == "aborted"
    if name == "compaction":
        summaries = [m for m in log.messages() if isinstance(m, dict)
                     and m.get("source") == {"kind": "plugin"}]
        assert len(summaries) == 1 and log.messages()[0] is summaries[0]


def test_a_plain_clone_runs_the_demo(tmp_path: Path, kafka_bootstrap: str,
                                     topic_prefix: str) -> None:
    """``git clone`` of HEAD into a folder with no ``shared/`` beside it; the demo (against
    the test broker: ``--external``) publishes the clone's samples and passes every check."""
    clone = tmp_path / "dsh-pipeline"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    assert not (tmp_path / "shared").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    env.update(PYTHONPATH=str(clone), DSH_BOOTSTRAP_SERVERS=kafka_bootstrap,
               DSH_TOPIC_PREFIX=topic_prefix, DSH_PARTITIONS="3",
               DSH_DASHBOARD_PORT="0", DSH_STATE_DIR=str(tmp_path / "state"))
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", "demo", "--external", "--sessions", "2",
         "--turns", "1"], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "read cancel.jsonl" in done.stderr
    summary = dict(part.split("=", 1) for part in done.stdout.strip().splitlines()[-1].split())
    assert summary["sessions"] == str(len(KINDS))
    assert summary["roundtrip_ok"] == "true"
    assert summary["fleet_sessions"] == "2" and summary["turns"] == "2"
    for key in ("invalid_logs", "session_failures", "derived_mismatches", "usage_mismatches"):
        assert summary[key] == "0", done.stdout
