"""Import and ship put many sessions in one transaction, and stay exactly-once per (session, seq).

Real broker; the files are synthetic dsh sessions written as dsh writes them (packed rows).
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fanout_support import SERDE, fanout_settings

from dsh_dev.synth import synth_session
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.topic_scan import TopicScan, last_seqs
from pipeline.codec.sessionfile import write_session_file
from pipeline.core.errors import EventError
from pipeline.services.replay.prepare import avro_encoder
from pipeline.services.replay.ship import Shipper
from pipeline.services.replay.transfer import Importer, read_session
from pipeline.settings import Settings

pytestmark = pytest.mark.broker
ROOT = Path(__file__).resolve().parents[3]
EVENTS = 50


@pytest.fixture
async def fan(kafka_bootstrap: str, topic_prefix: str) -> Settings:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    await ensure_topics(settings)
    return settings


def session_files(folder: Path, count: int, first: int = 0) -> list[Path]:
    paths = []
    for seed in range(first, first + count):
        path = folder / f"batch-{seed:03d}" / "session.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_session_file(path, synth_session(seed, EVENTS), packed=True,
                           header={"type": "session", "version": 0, "id": f"batch-{seed:03d}"})
        paths.append(path)
    return paths


async def records_per_session(settings: Settings) -> dict[str, int]:
    counts: dict[str, int] = {}
    async with TopicScan(settings, settings.topics.session_events) as scan:
        async for batch in scan.batches():
            for record in batch:
                key = (record.key or b"").decode()
                counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("workers", [0, 2], ids=["here", "2-workers"])
async def test_import_commits_groups_of_files_and_a_second_import_publishes_nothing(
        fan: Settings, tmp_path: Path, workers: int) -> None:
    paths = session_files(tmp_path, 20)
    lines: list[str] = []
    async with Importer(fan, SERDE.encode, SERDE.decode, batch_events=6 * EVENTS,
                        progress=lines.append, workers=workers,
                        make_encoder=avro_encoder) as importer:
        first = [r async for r in importer.import_files(paths)]
        assert importer.producer.transactions_committed == 4  # 6 + 6 + 6 + 2 files
        again = [r async for r in importer.import_files(paths)]
        assert importer.producer.transactions_committed == 4  # nothing new: no transaction
    assert [r.published for r in first] == [EVENTS] * 20
    assert all(r.published == 0 and r.already_on_topic == EVENTS for r in again)
    assert await records_per_session(fan) == {f"batch-{n:03d}": EVENTS for n in range(20)}
    assert lines[0].startswith(f"imported 6/20 files, {6 * EVENTS:,} events published (")
    assert lines[3].startswith(f"imported 20/20 files, {20 * EVENTS:,} events published (")
    assert (await read_session(fan, "batch-007", SERDE.decode)).events == synth_session(
        7, EVENTS)


async def test_a_conflict_refuses_its_file_and_the_rest_imports_once_later(
        fan: Settings, tmp_path: Path) -> None:
    paths = session_files(tmp_path, 6)
    async with Importer(fan, SERDE.encode, SERDE.decode) as importer:
        await importer.import_file(paths[2])   # batch-002 is on the topic now
    other = synth_session(99, EVENTS)           # a different log under the same id
    write_session_file(paths[2], other, packed=True,
                       header={"type": "session", "version": 0, "id": "batch-002"})
    async with Importer(fan, SERDE.encode, SERDE.decode) as importer:
        done = []
        with pytest.raises(EventError, match=r"batch-002.*conflicts with the topic"):
            async for result in importer.import_files(paths):
                done.append(result.session_id)
    assert done == ["batch-000", "batch-001"]    # the files before it, in one transaction
    assert await records_per_session(fan) == {"batch-000": EVENTS, "batch-001": EVENTS,
                                              "batch-002": EVENTS}
    async with Importer(fan, SERDE.encode, SERDE.decode) as importer:
        rest = [r async for r in importer.import_files(paths[:2] + paths[3:])]
    assert [r.published for r in rest] == [0, 0, EVENTS, EVENTS, EVENTS]
    assert await records_per_session(fan) == {f"batch-{n:03d}": EVENTS for n in range(6)}


async def test_ship_puts_many_files_in_one_transaction_and_a_copy_adds_nothing(
        fan: Settings, tmp_path: Path) -> None:
    paths = session_files(tmp_path, 12)
    copy = tmp_path / "batch-003-copy" / "session.jsonl.zstd"  # the same session, compressed
    copy.parent.mkdir()
    write_session_file(copy, synth_session(3, EVENTS), packed=True,
                       header={"type": "session", "version": 0, "id": "batch-003"})
    live: list[str] = []
    async with Shipper(fan, tmp_path, SERDE.encode, batch=5 * EVENTS,
                       live=live.append) as shipper:
        stats = await shipper.run()
    assert stats.transactions == 3 and stats.published == 12 * EVENTS  # 5 + 5 + 2 sessions
    assert live[-1] == f"shipped {12 * EVENTS:,} events, 13 files"
    assert await records_per_session(fan) == {f"batch-{n:03d}": EVENTS for n in range(12)}
    assert await last_seqs(fan, fan.topics.session_events) == {
        f"batch-{n:03d}": EVENTS - 1 for n in range(12)}
    assert len(paths) == 12


def test_import_shows_progress_on_a_terminal_only(fan: Settings, tmp_path: Path) -> None:
    paths = [str(p) for p in session_files(tmp_path, 3)]
    env = {**os.environ, **fan.to_env()}
    argv = [sys.executable, "-m", "pipeline.cli.main", "import", *paths]
    plain = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120, check=True)
    assert [json.loads(line)["published"] for line in plain.stdout.splitlines()] == [EVENTS] * 3
    assert "imported" not in plain.stderr and "\r" not in plain.stderr
    controller, terminal = pty.openpty()
    try:
        shown = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=terminal, text=True, timeout=120, check=True)
        os.close(terminal)
        screen = b""
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:
                break
            if not chunk:
                break
            screen += chunk
    finally:
        os.close(controller)
    assert "imported 3/3 files, 0 events published" in screen.decode()
    assert [json.loads(line)["published"] for line in shown.stdout.splitlines()] == [0] * 3


def test_kill_9_mid_import_then_again_publishes_each_event_once(fan: Settings,
                                                                 tmp_path: Path) -> None:
    paths = [str(p) for p in session_files(tmp_path, 40)]
    env = {**os.environ, **fan.to_env()}
    argv = [sys.executable, "-m", "pipeline.cli.main", "import", "--batch", str(2 * EVENTS),
            *paths]
    first = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
    assert first.stdout is not None
    committed = json.loads(first.stdout.readline())  # printed once its group is committed
    workers = _children(first.pid)
    assert workers, "the importer runs its worker processes"
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    assert committed["published"] == EVENTS
    deadline = time.monotonic() + 30
    while workers and time.monotonic() < deadline:  # its workers end without it
        workers = [pid for pid in workers if Path(f"/proc/{pid}").exists()
                   and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
        time.sleep(0.2)
    assert not workers, f"worker processes {workers} outlived the killed importer"
    again = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300, check=True)
    results = [json.loads(line) for line in again.stdout.splitlines()]
    assert sum(r["published"] + r["already_on_topic"] for r in results) == 40 * EVENTS
    assert results[0]["already_on_topic"] == EVENTS   # the first group stayed committed
    counts = asyncio.run(records_per_session(fan))
    assert counts == {f"batch-{n:03d}": EVENTS for n in range(40)}


def _children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nPPid:\t{pid}\n" in text:
            found.append(int(status.parent.name))
    return found
