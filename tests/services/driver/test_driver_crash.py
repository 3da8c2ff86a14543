"""Crash cycles: ``kill -9`` the driver process mid-turn, restart, many times.

After the cycles a last driver drains the inbox. Then, for every session: no duplicate and
no missing seq (the strict log rebuilds), no open turn (each interrupted turn was repaired),
and each inbox command entered the session exactly once (one insert splice per message id).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import uuid
from collections import Counter
from collections.abc import Sequence

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from driver_topics import PARTITIONS

from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.session_reader import read_session_partition
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.log import SessionLog
from pipeline.settings import Settings

# The timeout covers the session broker's start (conftest allows it 300 s on a loaded machine).
pytestmark = [pytest.mark.broker, pytest.mark.timeout(480)]
CYCLES = 4
SESSIONS = 4
FOLLOWUPS_PER_SESSION = 4


def driver_env(settings: Settings) -> dict[str, str]:
    return {**os.environ, "DSH_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "DSH_TOPIC_PREFIX": settings.topic_prefix, "DSH_PARTITIONS": str(PARTITIONS),
            "DSH_REPLICATION_FACTOR": "1", "DSH_GROUP_ID_PREFIX": settings.group_id_prefix}


async def start_driver(settings: Settings, extra_env: dict[str, str] | None = None,
                       extra_args: Sequence[str] = ()) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli.main", "driver", "--instance-id", "crash-test",
        "--session-timeout-ms", "6000", "--script-chunk-delay-ms", "60", "--grace", "1",
        "--metrics-port", "-1", *extra_args,
        env={**driver_env(settings), **(extra_env or {})}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), 60)
    except TimeoutError:
        process.kill()
        raise AssertionError("the driver process printed no ready line within 60 s") from None
    assert line.startswith(b"ready"), f"driver exited early ({process.returncode}): {line!r}"
    return process


async def inbox_drained(settings: Settings) -> bool:
    """Every inbox partition's committed offset of the driver group is at its end."""
    consumer = AIOKafkaConsumer(**client_options(settings),
                                group_id=f"{settings.group_id_prefix}driver",
                                enable_auto_commit=False, isolation_level="read_committed")
    await consumer.start()
    try:
        tps = [TopicPartition(settings.topics.inbox, p) for p in range(PARTITIONS)]
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            if (await consumer.committed(tp) or 0) < ends[tp]:
                return False
        return True
    finally:
        await consumer.stop()


async def all_events(settings: Settings) -> dict[str, list[Event]]:
    found: dict[str, list[Event]] = {}
    for partition in range(PARTITIONS):
        contents = await read_session_partition(settings, settings.topics.session_events,
                                                partition, EventSerde().decode)
        assert contents.undecodable == []
        found.update(contents.events)
    return found


async def test_kill_9_mid_turn_many_times_then_every_log_is_whole(topics: Settings) -> None:
    rng = random.Random(20261130)
    codec = InboxCodec()
    sent: dict[str, list[str]] = {f"s-crash-{n}": [] for n in range(SESSIONS)}
    records = []
    for round_ in range(FOLLOWUPS_PER_SESSION):
        for session, ids in sent.items():
            ids.append(str(uuid.uuid4()))
            command = FollowUp(session, ids[-1], ({"type": "text", "text": f"round {round_}"},))
            records.append(OutRecord(topics.topics.inbox, session.encode(),
                                     codec.encode(command)))
    await send_records(topics, records)

    for _ in range(CYCLES):
        process = await start_driver(topics)
        await asyncio.sleep(rng.uniform(0.3, 1.0))
        process.kill()  # SIGKILL: no shutdown, open transactions left behind
        await process.wait()

    final = await start_driver(topics)
    try:
        async def drained() -> None:
            while not await inbox_drained(topics):
                await asyncio.sleep(0.2)
        try:
            await asyncio.wait_for(drained(), 90)
        except TimeoutError:
            raise AssertionError("the last driver did not drain the inbox in 90 s") from None
        final.send_signal(signal.SIGTERM)
        await asyncio.wait_for(final.communicate(), 30)
        assert final.returncode == 0
    finally:
        if final.returncode is None:
            final.kill()
            await final.wait()

    logs = await all_events(topics)
    assert set(logs) == set(sent)
    interrupted = 0
    for session, events in logs.items():
        log = SessionLog(session, mode="strict")
        log.extend(events)  # no duplicate, no missing seq, every event valid
        assert not log.turn.in_turn, f"{session}: its last turn is still open"
        inserted = Counter(item["id"] for e in events if e.type == "agent/inbox/spliced"
                           for item in e.data.get("inserted", []))
        assert inserted == Counter(sent[session]), f"{session}: commands not entered once"
        starts = sum(1 for e in events if e.type == "turn/start")
        ends = [e.data["reason"]["kind"] for e in events if e.type == "turn/end"]
        assert starts == len(ends)
        interrupted += ends.count("interrupted")
    # The kills landed mid-turn at least once (else the test proved nothing about repair).
    assert interrupted >= 1, "no kill landed mid-turn"
