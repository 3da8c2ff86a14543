"""The processors on ``rocksdb://`` (the deployed store): the kill -9 recovery with takeover and
the graceful stop run again with every worker on RocksDB, and a local store that is ahead of
its changelog (faust writes the table data and the changelog offset separately, and a kill -9
can fall between) never yields a wrong table.

The existing tests are reused as they are (tests/services/processors/test_processors_recovery.py and
tests/services/processors/test_processors_offsets.py): the ``rocksdb_workers`` fixture makes every
:class:`processors_support.Worker` start with ``--store rocksdb://`` and a data folder of its
own slot, the lowest one no live worker holds. So a worker restarted after a kill -9 or a stop
reopens the RocksDB files its predecessor left (what a restart on the same host does), while two
live workers never share one (RocksDB locks its folder).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import rocksdict
from processors_support import (
    Worker,
    event_records,
    free_port,
    fresh_settings,
    generated_sessions,
)

# Imported under other names, so that pytest does not collect them a second time here.
from test_processors_offsets import (
    test_a_graceful_stop_persists_and_commits_what_was_folded as graceful_stop_check,
)
from test_processors_recovery import (
    test_kill9_mid_stream_then_restart_equals_full_replay_and_takeover as kill9_check,
)

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.services.processors.verify import verify_processors
from pipeline.settings import Settings

pytestmark = pytest.mark.broker
FAUST_OFFSET_KEY = b"__faust\0offset__"
FORGED = b"\x00not-what-the-changelog-holds"


@pytest.fixture
def rocksdb_workers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[Worker]]:
    """Every Worker started in the test runs on rocksdb://, in the lowest free data slot."""
    started: list[Worker] = []
    slots: dict[int, Worker] = {}
    original = Worker.__init__

    def on_rocksdb(self: Worker, settings: Settings, port: int, state_dir: Path,
                   extra: Sequence[str] = ()) -> None:
        slot = next(n for n in range(16)
                    if n not in slots or slots[n].proc.poll() is not None)
        data_dir = tmp_path / f"rocksdb-slot-{slot}"
        original(self, settings, port, state_dir,
                 [*extra, "--store", "rocksdb://", "--data-dir", str(data_dir)])
        slots[slot] = self
        started.append(self)

    monkeypatch.setattr(Worker, "__init__", on_rocksdb)
    yield started


async def test_kill9_recovery_and_takeover_on_rocksdb(
        rocksdb_workers: list[Worker], kafka_bootstrap: str, tmp_path: Path) -> None:
    await kill9_check(kafka_bootstrap, tmp_path)
    assert len(rocksdb_workers) == 3
    assert any((tmp_path / "rocksdb-slot-0").rglob("*.db*")), "no RocksDB files were written"


async def test_graceful_stop_on_rocksdb(rocksdb_workers: list[Worker], kafka_bootstrap: str,
                                        tmp_path: Path) -> None:
    await graceful_stop_check(kafka_bootstrap, tmp_path)
    assert len(rocksdb_workers) == 2


def _partition_dbs(data_dir: Path) -> list[Path]:
    """The RocksDB folders of every table partition under a worker's data folder."""
    return sorted(p for p in data_dir.rglob("*") if p.is_dir() and (p / "CURRENT").is_file())


@pytest.mark.parametrize("offset_marker", ["moved back", "kept"])
async def test_a_store_ahead_of_its_changelog_never_yields_a_wrong_table(
        kafka_bootstrap: str, tmp_path: Path, offset_marker: str) -> None:
    """The state a kill -9 leaves between faust's RocksDB data write and its changelog
    offset write (or before the changelog record was acknowledged): data that the changelog
    does not have. It is made exactly: after a worker was killed, every table partition gets
    a value under a real session key that no changelog record holds, its offset marker moved
    back (data written, offset not) or kept (data written, its changelog record never
    acknowledged). The restarted worker must show what a full replay gives."""
    settings = fresh_settings(kafka_bootstrap)
    await ensure_topics(settings)
    sessions = generated_sessions(41, 12, "rdb", ["m"], int(time.time() * 1000),
                                  max_chunks=20)
    data_dir = tmp_path / "rocksdb"
    extra = ["--store", "rocksdb://", "--data-dir", str(data_dir)]
    worker = Worker(settings, free_port(), tmp_path, extra)
    try:
        worker.wait_ready()
        await send_records(settings, [r for sid, events in sessions.items()
                                      for r in event_records(settings, sid, events)])
        assert (await verify_processors(worker.url(""), sessions, timeout_s=90)).ok
    finally:
        worker.kill9()
    dbs = _partition_dbs(data_dir)
    assert dbs, f"no RocksDB partition folders under {data_dir}"
    forged = 0
    for path in dbs:
        db = rocksdict.Rdict(str(path), options=rocksdict.Options(raw_mode=True))
        try:
            keys = [k for k in db.keys() if k != FAUST_OFFSET_KEY]  # noqa: SIM118 - raw mode
            for key in keys[:3]:
                db[key] = FORGED
                forged += 1
            if offset_marker == "moved back" and db.get(FAUST_OFFSET_KEY) is not None:
                db[FAUST_OFFSET_KEY] = b"0"
        finally:
            db.close()
    assert forged, "the stores held no table records to forge"

    restarted = Worker(settings, free_port(), tmp_path, extra)
    try:
        restarted.wait_ready()
        report = await verify_processors(restarted.url(""), sessions, timeout_s=120)
        assert report.ok, (report.problems[:10], restarted.tail(60))
    finally:
        restarted.stop()
    assert _forged_values(data_dir) == 0, "a forged value outlived the restart in the store"


def _forged_values(data_dir: Path) -> int:
    count = 0
    for path in _partition_dbs(data_dir):
        db = rocksdict.Rdict(str(path), options=rocksdict.Options(raw_mode=True))
        try:
            count += sum(1 for value in db.values() if value == FORGED)
        finally:
            db.close()
    return count
