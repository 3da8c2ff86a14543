"""``dsh-pipeline ship`` as a real process, killed with SIGKILL mid-way and restarted: every
event of every file ends up on the topic exactly once, in order (the topic is the checkpoint;
the killed shipper's open transaction is aborted by the new one's fencing)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fanout_support import SERDE, fanout_settings

from dsh_dev.synth import synth_header, synth_session
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.topic_scan import TopicScan, last_seqs
from pipeline.codec.sessionfile import write_session_file
from pipeline.settings import Settings

EVENTS_PER_SESSION = 20_000  # big enough that the kill lands mid-way on a fast machine
HANG_GUARD_S = 120.0


def _ship(settings: Settings, root: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DSH_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
           "DSH_TOPIC_PREFIX": settings.topic_prefix, "DSH_PARTITIONS": "3",
           "DSH_GROUP_ID_PREFIX": settings.group_id_prefix}
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "ship", str(root),
                             "--batch", "200", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


async def _published(settings: Settings) -> int:
    return sum(seq + 1 for seq in (await last_seqs(settings,
                                                   settings.topics.session_events)).values())


@pytest.mark.broker
def test_kill_9_mid_ship_then_restart_publishes_each_event_once(
        kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    asyncio.run(ensure_topics(settings))
    sessions = {f"kill-{seed}": synth_session(seed, EVENTS_PER_SESSION) for seed in (1, 2, 3)}
    for seed, (sid, events) in enumerate(sessions.items(), start=1):
        folder = tmp_path / sid
        folder.mkdir()
        name = "session.jsonl.zstd" if seed == 2 else "session.jsonl"
        write_session_file(folder / name, events, header={**synth_header(seed), "id": sid},
                           packed=True)
    total = sum(len(e) for e in sessions.values())

    first = _ship(settings, tmp_path, "--follow")
    deadline = time.monotonic() + HANG_GUARD_S
    while asyncio.run(_published(settings)) == 0:  # kill once its first batches are on
        assert first.poll() is None, first.stderr.read() if first.stderr else ""
        assert time.monotonic() < deadline, "the shipper never published anything"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert asyncio.run(_published(settings)) < total  # really killed mid-way

    second = _ship(settings, tmp_path)
    out, err = second.communicate(timeout=HANG_GUARD_S)
    assert second.returncode == 0, err.decode()
    assert b"shipped " in err and b'"problems": 0' in out

    async def read_back() -> dict[str, list[int]]:
        seqs: dict[str, list[int]] = {}
        async with TopicScan(settings, settings.topics.session_events) as scan:
            async for batch in scan.batches():
                for record in batch:
                    sid, event = SERDE.decode(record.value or b"")
                    seqs.setdefault(sid, []).append(event.seq)
        return seqs

    found = asyncio.run(read_back())
    assert found == {sid: list(range(len(events))) for sid, events in sessions.items()}
