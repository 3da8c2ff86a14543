"""Defects the chaos campaign found, each reproduced deterministically (see docs/chaos.md).

Marked ``xfail(strict=True)`` until fixed where they live: a fix makes the test pass, and the
strict mark then fails the run so that the mark is removed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.avro import EventSerde
from pipeline.codec.sessionfile import write_session_file
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.tools import builtin_registry
from pipeline.services.replay.ship import Shipper
from pipeline.services.replay.topic import read_sessions
from pipeline.settings import Settings
from pipeline.testing.synth import synth_header, synth_session

WAIT_S = 60.0


def _open_turn_cut(seed: int) -> tuple[int, int]:
    """(a length ending mid-turn, the length of the next whole turn) of synth session ``seed``."""
    events = synth_session(seed, 400)
    ends = [n + 1 for n, e in enumerate(events) if e.type == "turn/end"]
    return ends[0] + 5, ends[1]


@pytest.mark.xfail(strict=True, reason=(
    "two writers of one session: a driver assigned the partition repairs the open turn of a "
    "session a shipper is still appending (services/driver/partition.py build_partition), and "
    "the shipper then publishes seqs the repair used (docs/chaos.md, defects)"))
async def test_a_shipped_session_with_an_open_turn_keeps_one_writer(
        kafka_bootstrap: str, topic_prefix: str, group_id: str, tmp_path: Path) -> None:
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap,
                                 topic_prefix=topic_prefix, partitions=1, replication_factor=1,
                                 group_id_prefix=f"{topic_prefix}g-")
    await ensure_topics(settings)
    session_id, seed = "shipped-live", 42
    mid_turn, whole = _open_turn_cut(seed)
    events = synth_session(seed, whole)
    path = tmp_path / f"{session_id}.jsonl"
    header = {**synth_header(seed), "id": session_id}
    serde = EventSerde()
    async with Shipper(settings, tmp_path, serde.encode) as shipper:
        write_session_file(path, events[:mid_turn], header=header)  # dsh is mid-turn
        assert await shipper.pass_once() == mid_turn
        await _run_driver_until_built(settings, group_id)  # e.g. after a rebalance
        write_session_file(path, events, header=header)  # dsh goes on writing the turn
        await shipper.pass_once()
    found = await read_sessions(settings, serde.decode, only=[session_id])
    seqs = [logged.event.seq for logged in found.events[session_id]]
    assert len(seqs) == len(set(seqs)), f"seqs written twice: {len(seqs) - len(set(seqs))}"
    assert [logged.event for logged in found.events[session_id]] == events


async def _run_driver_until_built(settings: Settings, group_id: str) -> None:
    """A driver that owns the one partition, built (its crash repair done), then stopped."""
    ctx = driver_context(settings, group_id=group_id, tools=builtin_registry(), linger_ms=10)
    service = DriverService(ctx, DriverConfig(linger_ms=10, shutdown_grace_s=2,
                                              session_timeout_ms=6000))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))

    async def built() -> None:
        while not (service.ready.is_set() and service.owned
                   and not service.health()[1]["building"]):
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(built(), WAIT_S)
        await asyncio.sleep(1.0)  # the repair's transaction commits within the linger
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
