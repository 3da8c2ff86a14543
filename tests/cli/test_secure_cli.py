"""``dsh-pipeline broker --secure`` and ``dsh-pipeline demo --secure`` as a user runs them."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dsh_dev.localstack.process import free_ports
from pipeline.adapters.secure.security import ROLES, read_env_file
from pipeline.cli.main import build_parser

pytestmark = [pytest.mark.broker, pytest.mark.registry]
REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "pipeline.cli.main"]


def test_nodes_is_the_flag_and_cluster_still_works() -> None:
    parser = build_parser()
    assert parser.parse_args(["broker", "--nodes", "3"]).nodes == 3
    assert parser.parse_args(["broker", "--cluster", "3"]).nodes == 3
    assert parser.parse_args(["broker", "--secure"]).secure


@pytest.mark.jars
def test_secure_broker_prints_one_ready_line_and_private_env_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    err = tmp_path / "broker.err"
    broker = subprocess.Popen([*CLI, "broker", "--secure", "--port", "0", "--registry-port",
                               "0", "--ready-timeout", "300", "--run-dir", str(run_dir)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=err.open("w"),
                              text=True, env={**os.environ, "DSH_PARTITIONS": "2"})
    try:
        assert broker.stdout is not None
        ready = broker.stdout.readline()
        match = re.fullmatch(r"ready bootstrap=(127\.0\.0\.1:\d+) "
                             r"registry=(https://127\.0\.0\.1:\d+/apis/ccompat/v7) "
                             r"env=(\S+)/\{role\}\.env\n", ready)
        assert match, (ready, err.read_text()[-3000:])
        env_dir = Path(match[3])
        passwords = []
        for role in ROLES:
            path = env_dir / f"{role}.env"
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            env = read_env_file(path)
            assert env["DSH_SASL_USERNAME"] == role
            assert env["DSH_SECURITY_PROTOCOL"] == "SASL_SSL"
            assert env["DSH_BOOTSTRAP_SERVERS"] == match[1]
            passwords.append(env["DSH_SASL_PASSWORD"])
        assert len(set(passwords)) == len(ROLES)
        listed = subprocess.run([*CLI, "topics", "ensure"], cwd=REPO, capture_output=True,
                                text=True, timeout=120,
                                env={**os.environ, "DSH_PARTITIONS": "2",
                                     **read_env_file(env_dir / "admin.env")})
        assert listed.returncode == 0, listed.stderr
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(timeout=90) == 0
        assert broker.stdout.read() == ""  # exactly one line on stdout
        said = ready + err.read_text() + listed.stdout + listed.stderr
        assert not [p for p in passwords if p in said]
    finally:
        if broker.poll() is None:
            broker.kill()


@pytest.mark.jars
def test_secure_demo_prints_the_summary_with_every_mismatch_at_zero(tmp_path: Path) -> None:
    demo = subprocess.run(
        [*CLI, "demo", "--secure", "--sessions", "2", "--turns", "1",
         "--ready-timeout", "300s"], cwd=REPO, capture_output=True, text=True,
        timeout=900, env={**os.environ, "DSH_DASHBOARD_PORT": str(free_ports(1)[0]),
                          "DSH_STATE_DIR": str(tmp_path / "state")})
    assert demo.returncode == 0, demo.stderr[-4000:]
    assert demo.stdout.count("\n") == 1
    summary = dict(item.split("=", 1) for item in demo.stdout.split())
    assert summary["roundtrip_ok"] == "true"
    assert summary["fleet_sessions"] == "2" and summary["turns"] == "2"
    for key in ("invalid_logs", "session_failures", "derived_mismatches", "usage_mismatches"):
        assert summary[key] == "0", (key, demo.stderr[-3000:])
    assert "ACLs created" in demo.stderr
