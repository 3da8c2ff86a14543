"""No secret anywhere: the pipeline runs on the secure stack, every part as its own principal,
with known passwords and an LLM API key in its settings; then every log file, /metrics and
/health of each service, the dashboard's pages and API, the topics (values, keys and headers,
dead letters included) and `dsh-pipeline config` are searched for them: zero hits."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from secure_support import SecureStack

from dsh_dev.localstack.process import ChildProcess, free_ports
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord

pytestmark = [pytest.mark.broker, pytest.mark.registry]
ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-key-must-never-show-7d41c2"
DASHBOARD_TOKEN = "dashboard-token-must-never-show-93be"


def _cli(stack: SecureStack, role: str, args: list[str], log_dir: Path, name: str,
         extra_env: dict[str, str] | None = None) -> ChildProcess:
    env = {**stack.env(role), "DSH_DEEPSEEK_API_KEY": API_KEY, "DEEPSEEK_API_KEY": API_KEY,
           "DSH_DASHBOARD_TOKEN": DASHBOARD_TOKEN, **(extra_env or {})}
    return ChildProcess(name, [sys.executable, "-m", "pipeline.cli.main", *args],
                        log_dir / f"{name}.log", ROOT, env=env)


def _eventually(check: Callable[[], bool], timeout_s: float, what: str,
                procs: list[ChildProcess]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [p for p in procs if not p.alive()]
        assert not dead, f"{dead[0].name} exited:\n{dead[0].log_tail()}"
        try:
            if check():
                return
        except (OSError, ValueError, httpx.HTTPError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n" +
                         "\n".join(f"{p.name}: {p.log_tail()}" for p in procs))


def _get(url: str, token: bool = False) -> str:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {DASHBOARD_TOKEN}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode("utf-8", "replace")


async def _every_record(stack: SecureStack, only: str | None = None
                        ) -> dict[str, list[bytes]]:
    """Topic -> keys, values and headers of its every record (as the admin), of every topic
    or ``only`` that one. Read until 3 s bring nothing: call it on every topic only once the
    services are stopped (the processors' ticks never stop)."""
    consumer = AIOKafkaConsumer(**client_options(stack.role("admin")), group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        topics = [t for t in await consumer.topics()
                  if not t.startswith("__") and only in (None, t)]
        consumer.subscribe(topics)
        blobs: dict[str, list[bytes]] = {}
        idle = 0
        while idle < 3:
            batch = await consumer.getmany(timeout_ms=1000)
            idle = 0 if batch else idle + 1
            for tp, records in batch.items():
                found = blobs.setdefault(tp.topic, [])
                for r in records:
                    found += [r.key or b"", r.value or b""]
                    found += [name.encode() + b"=" + value for name, value in r.headers or ()]
        return blobs
    finally:
        await consumer.stop()


def test_no_secret_in_logs_metrics_pages_or_topics(secure_stack: SecureStack,
                                                   tmp_path: Path) -> None:
    stack = secure_stack
    secrets = [*stack.passwords, API_KEY, DASHBOARD_TOKEN]
    processors_port, driver_port, dashboard_port = free_ports(3)
    procs = [
        _cli(stack, "processors", ["processors", "--web-port", str(processors_port),
                                   "--loglevel", "info"], tmp_path, "processors",
             {"DSH_STATE_DIR": str(tmp_path / "state")}),
        _cli(stack, "driver", ["driver", "--metrics-port", str(driver_port),
                               "--script", "tool-loop"], tmp_path, "driver"),
        _cli(stack, "dashboard", ["dashboard", "--port", str(dashboard_port),
                                  "--loglevel", "INFO"], tmp_path, "dashboard"),
    ]
    processors = f"http://127.0.0.1:{processors_port}"
    driver = f"http://127.0.0.1:{driver_port}"
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    try:
        _eventually(lambda: '"ready": true' in _get(driver + "/health"), 240, "driver", procs)
        _eventually(lambda: "partitions" in _get(processors + "/health"), 240, "processors",
                    procs)
        sent = [subprocess.run([sys.executable, "-m", "pipeline.cli.main", "send", sid,
                                "--followup", f"hello {sid}"], cwd=ROOT,
                               env={**stack.env("ingest"), "DSH_DEEPSEEK_API_KEY": API_KEY},
                               capture_output=True, text=True, timeout=120, check=False)
                for sid in ("nosecret-1", "nosecret-2")]
        assert all(s.returncode == 0 for s in sent), [s.stderr for s in sent]
        # An undecodable event: the processors dead-letter it (headers say why).
        asyncio.run(send_records(stack.role("ingest"), [OutRecord(
            stack.base.topics.session_events, b"nosecret-3", b"\x00garbage")]))
        _eventually(lambda: "nosecret-2" in _get(dashboard + "/api/fleet", token=True), 240,
                    "the sessions on the dashboard", procs)
        dlq = stack.base.topics.dlq(stack.base.topics.session_events)
        # the dead letter commits with the processors' next commit, maybe after the fleet
        _eventually(lambda: any(b"nosecret-3" in blob for blob in asyncio.run(
            _every_record(stack, only=dlq)).get(dlq, [])), 120, "the dead letter", procs)
        config = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "config"],
                                cwd=ROOT, env={**stack.env("admin"),
                                               "DSH_DEEPSEEK_API_KEY": API_KEY},
                                capture_output=True, text=True, timeout=60, check=True)
        seen = {
            "driver /metrics": _get(driver + "/metrics"),
            "driver /health": _get(driver + "/health"),
            "processors /metrics": _get(processors + "/metrics"),
            "processors /health": _get(processors + "/health"),
            "dashboard /": _get(dashboard + "/", token=True),
            "dashboard /api/fleet": _get(dashboard + "/api/fleet", token=True),
            "dashboard /api/charts": _get(dashboard + "/api/charts", token=True),
            "dashboard /api/sessions/nosecret-1": _get(
                dashboard + "/api/sessions/nosecret-1", token=True),
            "dashboard /metrics": _get(dashboard + "/metrics", token=True),
            "dashboard /health": _get(dashboard + "/health"),
            "config": config.stdout + config.stderr,
        }
    finally:
        for proc in procs:
            proc.stop(30)
    by_topic = asyncio.run(_every_record(stack))
    blobs = [blob for found in by_topic.values() for blob in found]
    assert any(b"nosecret-1" in blob for blob in blobs), "the topics hold no session"
    dead_letters = by_topic.get(stack.base.topics.dlq(stack.base.topics.session_events), [])
    assert any(b"nosecret-3" in blob for blob in dead_letters), sorted(by_topic)
    logs = {str(p): p.read_text(errors="replace") for p in tmp_path.rglob("*.log")}
    logs |= {str(p): p.read_text(errors="replace")
             for p in stack.folder.rglob("*.log")}  # the brokers' and the registry's own
    assert len(logs) >= 4
    hits = [f"{where} holds secret #{n}" for n, secret in enumerate(secrets)
            for where, text in {**seen, **logs}.items() if secret in text]
    hits += [f"a record holds secret #{n}" for n, secret in enumerate(secrets)
             for blob in blobs if secret.encode() in blob]
    assert not hits, hits
