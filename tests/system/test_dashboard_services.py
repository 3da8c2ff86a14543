"""Every service's ``/metrics`` over real traffic: a driver and a processors worker (real
subprocesses) and the dashboard, on one broker. Each body parses with the official Prometheus
text parser, the counters move with the sessions the test runs, and the dashboard reports the
consumer lag of the driver's and the processors' groups."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_support import aget, dashboard_settings, eventually, prometheus_samples
from processors_support import ROOT, Worker, free_port, worker_env

from pipeline.codec.avro import EventSerde
from pipeline.services.dashboard.server import start_dashboard
from pipeline.services.dashboard.service import DashboardConfig
from pipeline.settings import Settings

SESSIONS = ("metrics-a", "metrics-b", "metrics-c")


def _total(samples: dict[Any, float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


@pytest.fixture
def driver(kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> Iterator[str]:
    """A ``dsh-pipeline driver`` subprocess (scripted provider); yields its status URL."""
    settings = dashboard_settings(kafka_bootstrap, topic_prefix)
    port = free_port()
    log = open(tmp_path / "driver.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "driver",
                             "--metrics-host", "127.0.0.1", "--metrics-port", str(port)],
                            cwd=ROOT, env=worker_env(settings, tmp_path), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def _send_followups(settings: Settings, tmp_path: Path) -> None:
    for session_id in SESSIONS:
        subprocess.run([sys.executable, "-m", "pipeline.cli.main", "send", session_id,
                        "--followup", f"hello from {session_id}"], cwd=ROOT, check=True,
                       env=worker_env(settings, tmp_path), capture_output=True, timeout=60)


async def test_metrics_of_driver_processors_and_dashboard_move_with_traffic(
        kafka_bootstrap: str, topic_prefix: str, tmp_path: Path, dashboard_worker: Worker,
        driver: str) -> None:
    settings = dashboard_settings(kafka_bootstrap, topic_prefix)

    async def driver_ready() -> Any:
        status, _, body = await aget(driver + "health")
        return status == 200 and '"ready": true' in body
    await eventually(driver_ready, 240, "the driver ready")  # a loaded 2-core box is slow
    dashboard = await start_dashboard(settings, EventSerde().decode, host="127.0.0.1", port=0,
                                      config=DashboardConfig(lag_interval_s=0.5))
    try:
        await asyncio.to_thread(dashboard_worker.wait_ready)  # the dashboard's loops run meanwhile
        before = prometheus_samples((await aget(dashboard_worker.url("/metrics")))[2])

        async def tail_started() -> Any:  # it reads the live tail from its start-up on
            return json.loads((await aget(dashboard.url + "health"))[2])["tailStart"]
        await eventually(tail_started, 60, "the dashboard's tail started")
        await asyncio.to_thread(_send_followups, settings, tmp_path)

        async def turns_seen() -> Any:
            samples = prometheus_samples((await aget(dashboard.url + "metrics"))[2])
            return samples if _total(samples, "dsh_dashboard_turns_ended_total") >= 3 else None
        board = await eventually(turns_seen, 120, "three turns on the dashboard")
        assert _total(board, "dsh_dashboard_steps_ended_total") >= 3
        assert _total(board, "dsh_dashboard_tokens_total") > 0

        drv = prometheus_samples((await aget(driver + "metrics"))[2])
        assert drv[("dsh_driver_commands_total", ())] >= 3
        assert drv[("dsh_driver_events_committed_total", ())] > 0
        assert drv[("dsh_driver_transactions_total", ())] > 0

        async def processors_folded() -> Any:
            samples = prometheus_samples((await aget(dashboard_worker.url("/metrics")))[2])
            applied = samples[("dsh_processors_applied_total", ())]
            owned = samples[("dsh_processors_sessions", ())]
            moved = applied > before[("dsh_processors_applied_total", ())]
            return samples if moved and owned >= len(SESSIONS) else None
        procs = await eventually(processors_folded, 120, "the processors folding the new events")
        assert procs[("dsh_processors_in_recovery", ())] == 0
        assert procs[("dsh_processors_recovery_remaining_offsets", (("replica", "active"),))] == 0
        assert procs[("dsh_processors_partitions_owned", ())] == settings.partitions

        async def lag_of_both_groups() -> Any:
            samples = prometheus_samples((await aget(dashboard.url + "metrics"))[2])
            topics = {dict(labels)["topic"] for (name, labels) in samples
                      if name == "dsh_dashboard_consumer_lag_seconds"}
            return topics >= {settings.topics.inbox, settings.topics.session_events}
        await eventually(lag_of_both_groups, 60, "lag of the driver and processors groups")
    finally:
        await dashboard.stop()
