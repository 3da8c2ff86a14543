"""``dsh-pipeline dashboard`` as a command: help, and a clear error for a taken port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "pipeline.cli.main"]


def test_help_names_the_settings() -> None:
    done = subprocess.run([*CLI, "dashboard", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0
    assert "--port" in done.stdout and "DSH_DASHBOARD_PORT" in done.stdout


def test_a_taken_port_is_a_clear_error_not_a_traceback() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "DSH_DASHBOARD_PORT": str(port),
               "DSH_DASHBOARD_TOKEN": "never-printed-secret"}
        done = subprocess.run([*CLI, "dashboard", "--host", "127.0.0.1"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=240)
    assert done.returncode == 2
    assert f"dashboard cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
    assert "never-printed-secret" not in done.stdout + done.stderr
