"""Helpers of the processors' broker tests: publish sessions, run workers, read their HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.avro import EventSerde
from pipeline.codec.records import event_headers, record_key
from pipeline.core.events import Event
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
WORKER_READY_S = 90.0


def event_records(settings: Settings, session_id: str, events: Iterable[Event],
                  serde: EventSerde | None = None) -> list[OutRecord]:
    serde = serde or EventSerde()
    topic = settings.topics.session_events
    return [OutRecord(topic, record_key(session_id), serde.encode(session_id, e),
                      tuple(event_headers(e))) for e in events]


def worker_env(settings: Settings, state_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "DSH_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "DSH_TOPIC_PREFIX": settings.topic_prefix,
        "DSH_PARTITIONS": str(settings.partitions),
        "DSH_REPLICATION_FACTOR": str(settings.replication_factor),
        "DSH_GROUP_ID_PREFIX": settings.group_id_prefix,
        "DSH_STATE_DIR": str(state_dir),
    })
    return env


class Worker:
    """One ``dsh-pipeline processors`` subprocess and its HTTP port."""

    def __init__(self, settings: Settings, port: int, state_dir: Path,
                 extra: Sequence[str] = ()) -> None:
        self.port = port
        self.log_path = state_dir / f"worker-{port}.log"
        state_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        argv = [sys.executable, "-m", "pipeline.cli.main", "processors", "--web-port",
                str(port), "--loglevel", "INFO", *extra]
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=worker_env(settings, state_dir),
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.url(path), timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def wait_for(self, what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited ({self.proc.returncode}) waiting for "
                                     f"{what}; log:\n{self.tail()}")
            try:
                if check():
                    return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; log:\n{self.tail()}")

    def wait_ready(self) -> None:
        """Up, assigned and done recovering."""
        def ready() -> bool:
            status, body = self.get("/health")
            return status == 200 and not body["recovery"]["in_recovery"] and bool(
                body["partitions"])
        self.wait_for("worker ready", ready, WORKER_READY_S)

    def tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
