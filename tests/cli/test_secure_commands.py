"""Every file command works on the secure stack (DSH_SECURITY_PROTOCOL=SASL_SSL), each run as
the principal of its role (docs/security.md): import (ingest), tail and export (dashboard),
check and topics ensure (admin), replay (replay)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from secure_support import SecureStack
from shared_paths import SHARED_DIR

from pipeline.codec.sessionfile import read_session_file

pytestmark = [pytest.mark.broker, pytest.mark.registry]
ROOT = Path(__file__).resolve().parents[2]
SAMPLE = SHARED_DIR / "fixtures" / "dsh-format0" / "tool-call-turn.jsonl"


def _run(stack: SecureStack, role: str, *args: str,
         timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", *args], cwd=ROOT,
                          env=stack.env(role), capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    for password in stack.passwords:
        assert password not in done.stdout + done.stderr
    return done


def test_import_export_check_replay_and_topics_as_their_principals(
        secure_stack: SecureStack, tmp_path: Path) -> None:
    session_id = "secure-commands-1"
    imported = _run(secure_stack, "ingest", "import", "--session-id", session_id, str(SAMPLE))
    assert imported.returncode == 0, imported.stderr

    out = tmp_path / "exported.jsonl"
    exported = _run(secure_stack, "dashboard", "export", "-o", str(out), session_id)
    assert exported.returncode == 0, exported.stderr
    assert [e.seq for e in read_session_file(out).events] == [
        e.seq for e in read_session_file(SAMPLE).events]

    tail = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "tail",
                             "--from-beginning", session_id], cwd=ROOT,
                            env=secure_stack.env("dashboard"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        shown, errors = tail.communicate(timeout=20)  # tail follows: it is stopped below
    except subprocess.TimeoutExpired:
        tail.terminate()
        shown, errors = tail.communicate(timeout=20)
    assert "tool" in shown, (shown[-2000:], errors[-2000:])

    checked = _run(secure_stack, "admin", "check", session_id)
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout.strip().splitlines()[-1])

    replayed = _run(secure_stack, "replay", "replay", "--session", session_id, "--jsonl")
    assert replayed.returncode == 0, replayed.stderr
    assert session_id in replayed.stdout or replayed.stdout.strip()

    ensured = _run(secure_stack, "admin", "topics", "ensure")
    assert ensured.returncode == 0, ensured.stderr
    assert json.loads(ensured.stdout)["created"] == []

    refused = _run(secure_stack, "dashboard", "import", "--session-id", "secure-commands-2",
                   str(SAMPLE))
    assert refused.returncode != 0
    assert "User:dashboard" in refused.stderr, refused.stderr
