"""A processors worker that loses its authorization while running (its Write ACL on the derived
messages, or its Read ACL on the session topic, removed) stops its work, says why (the
principal and the refused topic, never the password) and exits non-zero; it loses nothing it
acknowledged: its committed offsets cover what it folded before, and once the ACL is back a
restarted worker's tables equal a replay of every event.

The test runs on a topic prefix of its own, its ACL plan added to the session's secure stack,
so no other secure test's processors group or topics are involved.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from processors_support import (
    Worker,
    committed_and_ends,
    event_records,
    free_port,
    generated_sessions,
)
from secure_support import SecureStack

from dsh_dev.cli.cmd_broker import role_settings
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.secure.acls import acl_plan
from pipeline.adapters.secure.security import read_env_file
from pipeline.services.processors.verify import verify_processors
from pipeline.settings import Settings

pytestmark = [pytest.mark.broker, pytest.mark.registry]
EXIT_WAIT_S = 180.0


def _as(stack: SecureStack, settings: Settings, role: str) -> Settings:
    return role_settings(stack.stack, settings, 1, role)


def _wait_exit(worker: Worker, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while worker.proc.poll() is None:
        assert time.monotonic() < deadline, f"the worker did not stop:\n{worker.tail(80)}"
        time.sleep(0.5)
    return worker.proc.returncode


@pytest.mark.parametrize("lost", ["write", "read"])
async def test_processors_losing_an_acl_stop_say_why_and_lose_nothing(
        secure_stack: SecureStack, tmp_path: Path, lost: str) -> None:
    """``write``: Write on the derived messages; ``read``: Read on the session topic."""
    stack = secure_stack
    prefix = f"rv{uuid.uuid4().hex[:8]}."
    settings = _as(stack, replace(stack.base, topic_prefix=prefix,
                                  group_id_prefix=f"{prefix}g-"), "admin")
    plan = acl_plan(settings)
    await asyncio.to_thread(stack.stack.change_acls, plan)
    await ensure_topics(_as(stack, settings, "admin"))
    ingest, admin = _as(stack, settings, "ingest"), _as(stack, settings, "admin")
    secure_env = read_env_file(stack.security.env_file("processors"))
    topic, operation = ((settings.topics.derived_messages, "Write") if lost == "write"
                        else (settings.topics.session_events, "Read"))
    revoked = [r for r in plan if r.principal == "processors" and r.name == topic]
    assert revoked and all(operation in r.operations for r in revoked)

    now_ms = int(time.time() * 1000)
    before = generated_sessions(41, 6, "rv1", ["m"], now_ms, max_chunks=20)
    after = generated_sessions(42, 6, "rv2", ["m"], now_ms, max_chunks=20)
    worker = Worker(settings, free_port(), tmp_path, env=secure_env)
    try:
        worker.wait_ready()
        await send_records(ingest, [r for sid, events in before.items()
                                    for r in event_records(settings, sid, events)])
        assert (await verify_processors(worker.url(""), before, timeout_s=90)).ok
        acknowledged = await _wait_committed(admin, worker)

        await asyncio.to_thread(stack.stack.change_acls, revoked, remove=True)
        await send_records(ingest, [r for sid, events in after.items()
                                    for r in event_records(settings, sid, events)])
        code = await asyncio.to_thread(_wait_exit, worker, EXIT_WAIT_S)
    finally:
        worker.stop()
    said = worker.log_path.read_text(errors="replace")
    assert code != 0, said[-3000:]
    assert "User:processors" in said and topic in said, said[-3000:]
    assert "not authorized" in said, said[-3000:]
    for password in stack.passwords:
        assert password not in said
    committed, ends = await committed_and_ends(admin)
    assert all(committed[p] >= acknowledged[p] for p in committed), (committed, acknowledged)
    assert committed != ends, "the refused batches were committed"

    await asyncio.to_thread(stack.stack.change_acls, revoked)
    again = Worker(settings, free_port(), tmp_path, env=secure_env)
    try:
        again.wait_ready()
        report = await verify_processors(again.url(""), {**before, **after}, timeout_s=120)
        assert report.ok, (report.problems, again.tail(60))
        await _wait_committed(admin, again)
    finally:
        again.stop()


async def _wait_committed(admin: Settings, worker: Worker) -> dict[int, int]:
    """Until the group's committed offsets reach the end of every partition; those offsets."""
    deadline = time.monotonic() + 90
    while True:
        committed, ends = await committed_and_ends(admin)
        if committed == ends:
            return committed
        assert time.monotonic() < deadline, (committed, ends, worker.tail())
        await asyncio.sleep(0.5)
