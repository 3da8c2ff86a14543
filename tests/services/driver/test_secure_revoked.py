"""A driver that loses its authorization while running (its Write ACL on the session topic
removed) stops, says why (the principal and the refused topic, never a password) and exits
non-zero, and loses nothing: once the ACL is back, a restarted driver runs the command it
could not commit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from secure_support import SecureStack

from dsh_dev.localstack.process import ChildProcess, free_ports
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.secure.acls import acl_plan
from pipeline.codec.records import HEADER_TYPE

pytestmark = [pytest.mark.broker, pytest.mark.registry]
ROOT = Path(__file__).resolve().parents[3]


def _driver(stack: SecureStack, port: int, log: Path) -> ChildProcess:
    return ChildProcess("driver", [sys.executable, "-m", "pipeline.cli.main", "driver",
                                   "--metrics-port", str(port), "--grace", "2"],
                        log, ROOT, env=stack.env("driver"))


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
            return b'"ready": true' in answer.read()
    except OSError:
        return False


def _send(stack: SecureStack, session_id: str, text: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "send", session_id,
                           "--followup", text], cwd=ROOT, env=stack.env("ingest"),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


async def _turn_ends(stack: SecureStack, session_id: str, wait_s: float) -> int:
    """turn/end records of ``session_id`` on the session topic (committed ones), read until
    ``wait_s`` has passed without a new one."""
    consumer = AIOKafkaConsumer(**client_options(stack.role("admin")), group_id=None,
                                auto_offset_reset="earliest", isolation_level="read_committed")
    await consumer.start()
    ends = 0
    try:
        consumer.subscribe([stack.base.topics.session_events])
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for r in records:
                    if r.key == session_id.encode() and (HEADER_TYPE, b"turn/end") in (
                            r.headers or ()):
                        ends += 1
                        deadline = time.monotonic() + wait_s
    finally:
        await consumer.stop()
    return ends


def _wait(check: object, timeout_s: float, what: str, proc: ChildProcess) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(check) and check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n{proc.log_tail()}")


def test_a_driver_losing_its_write_acl_stops_says_why_and_loses_nothing(
        secure_stack: SecureStack, tmp_path: Path) -> None:
    stack = secure_stack
    session_id = f"revoked-{int(time.time())}"
    write = [r for r in acl_plan(stack.base) if r.principal == "driver"
             and r.name == stack.base.topics.session_events]
    port = free_ports(1)[0]
    driver = _driver(stack, port, tmp_path / "driver.log")
    try:
        _wait(lambda: _ready(port), 240, "the driver", driver)
        _send(stack, session_id, "first")
        _wait(lambda: asyncio.run(_turn_ends(stack, session_id, 3)) == 1, 120,
              "the first turn", driver)
        stack.stack.change_acls(write, remove=True)
        _send(stack, session_id, "second")
        _wait(lambda: not driver.alive(), 180, "the driver to stop", driver)
        assert asyncio.run(_turn_ends(stack, session_id, 5)) == 1, "a refused turn was written"
    finally:
        driver.stop(30)
    said = driver.log_path.read_text(errors="replace")
    assert driver.returncode not in (0, None), said[-3000:]
    assert "not authorized for topic" in said and stack.base.topics.session_events in said
    assert "User:driver" in said, said[-3000:]
    for password in stack.passwords:
        assert password not in said

    stack.stack.change_acls(write)
    again = _driver(stack, port, tmp_path / "driver-again.log")
    try:
        _wait(lambda: _ready(port), 240, "the restarted driver", again)
        _wait(lambda: asyncio.run(_turn_ends(stack, session_id, 3)) == 2, 180,
              "the second turn after the ACL came back", again)
    finally:
        again.stop(30)
