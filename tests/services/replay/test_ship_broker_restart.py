"""A following shipper outlives a broker restart: the pass that fails on the broker starts
over from the topic (a new producer, the checkpoint read again), and every event of the
files is on the topic exactly once (:mod:`pipeline.services.replay.ship`). Its own one-node
broker, killed with ``kill -9`` and restarted on the same storage and port."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dsh_dev.localstack.artifacts import Artifacts
from dsh_dev.localstack.kafka import KafkaLocal
from dsh_dev.synth import synth_header, synth_session
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.topic_scan import last_seqs
from pipeline.codec.avro import EventSerde
from pipeline.codec.sessionfile import write_session_file
from pipeline.services.replay.ship import Shipper
from pipeline.services.replay.topic import read_sessions
from pipeline.settings import Settings

pytestmark = [pytest.mark.cluster,  # a broker of its own, killed and restarted
              pytest.mark.jars]

WAIT_S = 180.0
# A pass on the killed broker fails after one request timeout, and its abort after another:
# 10 s each rather than the default 30 s (a healthy broker answers well within either).
REQUEST_TIMEOUT_S = 10.0


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[KafkaLocal]:
    kafka = KafkaLocal(Artifacts.default().require_kafka(), tmp_path / "kafka", heap_mb=384)
    try:
        kafka.start(budget_s=300)
        yield kafka
    finally:
        kafka.stop()


async def _until(what: str, check: Callable[[], bool], task: asyncio.Task[object]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if task.done():
            task.result()
            raise AssertionError(f"the shipper stopped before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_a_following_shipper_starts_over_after_the_broker_restarts(
        own_broker: KafkaLocal, tmp_path: Path) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    settings = Settings.from_env({}, bootstrap_servers=own_broker.bootstrap, topic_prefix=prefix,
                                 partitions=1, replication_factor=1,
                                 group_id_prefix=f"{prefix}g-")
    await ensure_topics(settings)
    files = tmp_path / "files"
    files.mkdir()
    sessions = {f"ship-{seed}": synth_session(seed, 120) for seed in (3, 4)}
    (first, first_events), (second, second_events) = sessions.items()
    write_session_file(files / f"{first}.jsonl", first_events,
                       header={**synth_header(3), "id": first})
    lines: list[str] = []
    serde = EventSerde()
    node = own_broker.nodes[0].node_id
    async with Shipper(settings, files, serde.encode, progress=lines.append,
                       request_timeout_s=REQUEST_TIMEOUT_S) as shipper:
        task: asyncio.Task[object] = asyncio.create_task(
            shipper.run(follow=True, interval_s=0.2))
        try:
            await _until("the first file is shipped",
                         lambda: shipper.stats.published == len(first_events), task)
            # Killed once its commit markers are written too: killed between the commit and
            # its markers, this one-node broker may skip them at restart and leave the
            # transaction hanging (pipeline.adapters.kafka.settled_ends), which no client
            # can get past. tests/adapters/test_settled_ends.py covers the markers' wait.
            assert await last_seqs(settings, settings.topics.session_events) \
                == {first: len(first_events) - 1}
            own_broker.kill9(node)
            killed_at = len(lines)  # a pass failing before the kill (a slow start) is not it
            write_session_file(files / f"{second}.jsonl", second_events,
                               header={**synth_header(4), "id": second})
            await _until("a pass fails on the broker",
                         lambda: any("starting over" in line for line in lines[killed_at:]),
                         task)
            own_broker.restart(node)
            await asyncio.to_thread(own_broker.wait_ready, 120)
            await _until("the second file is shipped",
                         lambda: second in shipper.next_seq
                         and shipper.next_seq[second] == len(second_events), task)
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    found = await read_sessions(settings, serde.decode, only=list(sessions))
    said = "\n".join(lines)  # the shipper's passes, so a failure shows what it saw
    for session_id, events in sessions.items():
        seqs = [logged.event.seq for logged in found.events[session_id]]
        assert seqs == [e.seq for e in events], f"{session_id}: seqs {seqs}\n{said}"
        assert [logged.event for logged in found.events[session_id]] == events, session_id
