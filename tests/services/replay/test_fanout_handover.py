"""A switched projection stays live: the handover between ``replay`` and live writers.

Pure rules first (pointer records, routing by covered offsets), then the real broker: a
stand-in writer that follows the pointer through ``ProjectionFollow`` exactly as a processors
worker is to (gate before each record, publish where the gate says) keeps folding while
``replay`` rebuilds, holds, hands over, and continues into the new version; events published
before, during and after the handover all end up in the active version, once. The same with
the real processors worker, which follows the pointer through its own ``ProjectionFollow``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from fanout_support import FIXTURES, SERDE, fanout_settings, publish

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.event_stream import EventStream, Start, partition_for
from pipeline.adapters.kafka.projection_follow import ProjectionFollow
from pipeline.adapters.kafka.topic_scan import BulkProducer, TopicScan
from pipeline.cli.main import main
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import BrokerError, EventError
from pipeline.core.events import Event, dumps_json
from pipeline.core.projection import (
    ActivePointer,
    HandoverRequest,
    HeldBy,
    PointerState,
    fold_pointer_records,
    fold_slots,
    handover_key,
    held_key,
    layout_key,
    publish_topic,
    with_session,
    writer_key,
)
from pipeline.core.surface import SurfaceFold
from pipeline.sdk import active_version, derived_conversations
from pipeline.services.replay.rebuild import read_conversations, replay_projection
from pipeline.services.replay.versions import read_pointer, write_pointer
from pipeline.settings import Settings

NAMES = ("text-turn", "tool-call-turn", "agent-instructions")
P = "derived-messages"


def _record(key: str, value: object) -> tuple[bytes, bytes | None]:
    return key.encode(), None if value is None else json.dumps(value).encode()


def test_pointer_state_folds_active_handover_writers_and_answers() -> None:
    request = HandoverRequest(2, "x.derived-messages.v2", "r-1")
    state = fold_pointer_records(P, [
        _record(P, ActivePointer(1, "x.derived-messages.v1", 10, {0: 5}).to_json(P)),
        _record(writer_key(P, "w1"), {"worker": "w1"}),
        _record(writer_key(P, "w2"), {"worker": "w2"}),
        _record(writer_key(P, "w2"), None),
        _record(handover_key(P), request.to_json()),
        _record(held_key(P, "w1"), HeldBy("r-1", frozenset({0, 2})).to_json()),
        _record(held_key(P, "old"), HeldBy("r-0", frozenset({1})).to_json()),
        _record("usage/writer/w9", {"worker": "w9"}),  # another projection: ignored
    ])
    assert state.active == ActivePointer(1, "x.derived-messages.v1", 10, {0: 5})
    assert state.pending() == request
    assert set(state.writers) == {"w1"}
    assert state.held_partitions("r-1") == {0, 2}  # an answer to an older request never counts


def test_a_handover_is_pending_only_until_its_version_is_active() -> None:
    state = PointerState(P)
    state.apply(handover_key(P), HandoverRequest(1, "t.v1", "r").to_json())
    assert state.pending() is not None
    state.apply(P, ActivePointer(1, "t.v1").to_json(P))
    assert state.pending() is None  # activated before the request was withdrawn: not pending


def test_publish_topic_splits_the_log_at_the_covered_offsets() -> None:
    active = ActivePointer(3, "t.v3", 0, {0: 100, 1: 0})
    assert publish_topic(active, 0, 99) is None  # the rebuild wrote it
    assert publish_topic(active, 0, 100) == "t.v3"
    assert publish_topic(active, 1, 0) == "t.v3"
    assert publish_topic(active, 2, 7) == "t.v3"  # a partition the rebuild found empty
    assert publish_topic(ActivePointer(0, "t"), 0, 0) == "t"


def test_a_layout_record_says_where_a_topics_changes_lie() -> None:
    state = fold_pointer_records(P, [
        _record(layout_key(P, "t.v1"), {"layout": "session"}),
        _record(layout_key(P, "t.v2"), {"layout": "session"}),
        _record(layout_key(P, "t.v2"), None),
    ])
    assert (state.layout_of("t.v1"), state.layout_of("t.v2"), state.layout_of("t")) == (
        "session", "key", "key")   # no record (or a tombstone): the default partitioner
    assert (state.partition_of("t.v1", 2), state.partition_of("t", 2)) == (2, None)
    with pytest.raises(EventError, match="layout must be 'key' or 'session', got 'slot'"):
        fold_pointer_records(P, [_record(layout_key(P, "t.v3"), {"layout": "slot"})])


def test_a_malformed_pointer_record_is_an_error_naming_it() -> None:
    with pytest.raises(EventError, match="projection-versions record b'derived-messages'"):
        fold_pointer_records(P, [(P.encode(), b"[1, 2]")])
    with pytest.raises(EventError, match="KeyError"):
        fold_pointer_records(P, [_record(handover_key(P), {"version": 1})])


def _split(name: str) -> list[list[Event]]:
    events = read_session_file(FIXTURES / f"{name}.jsonl").events
    third = len(events) // 3
    return [events[:third], events[third:2 * third], events[2 * third:]]


def _expected() -> dict[str, object]:
    return {n: json.loads((FIXTURES / f"{n}.derived.json").read_text()) for n in NAMES}


class StandInWriter:
    """What a processors worker does with a ProjectionFollow, over core's fold."""

    def __init__(self, settings: Settings, follow: ProjectionFollow) -> None:
        self.settings = settings
        self.follow = follow
        self.slots: dict[str, SurfaceFold] = {}
        self.folded = 0
        self.published: dict[str, int] = {}  # topic -> changes published there

    async def run(self) -> None:
        async with EventStream(self.settings, decode=SERDE.decode,
                               start=Start.BEGINNING) as stream, \
                BulkProducer(self.settings) as out:
            async for record in stream:
                topic = await self.follow.gate(record.partition, record.offset)
                event = record.event
                slots = self.slots.setdefault(record.session_id,
                                              SurfaceFold(keep_messages=False))
                changes = with_session(fold_slots(slots, event), record.session_id)
                if topic is not None and changes:
                    where = self.follow.partition_of(record.partition)
                    await out.send_many(topic, [
                        (c.key.encode(), None if (v := c.to_json()) is None
                         else dumps_json(v).encode(), ()) for c in changes],
                        partition_of=None if where is None else _always(where))
                    await out.flush()
                    self.published[topic] = self.published.get(topic, 0) + len(changes)
                self.folded += 1


def _always(partition: int) -> Callable[[bytes], int]:
    return lambda _key: partition


async def _until(what: str, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def _handover_with_a_live_writer(settings: Settings) -> StandInWriter:
    await ensure_topics(settings)
    parts = {name: _split(name) for name in NAMES}
    for name in NAMES:
        await publish(settings, name, parts[name][0])
    follow = ProjectionFollow(settings, "stand-in", lambda: range(settings.partitions),
                              poll_s=0.2, holding_poll_s=0.2)
    await follow.start()
    writer = StandInWriter(settings, follow)
    task = asyncio.get_running_loop().create_task(writer.run())
    try:
        first = sum(len(p[0]) for p in parts.values())
        await _until("the first third folded", lambda: writer.folded == first)
        replay = asyncio.get_running_loop().create_task(
            replay_projection(settings, SERDE.decode, handover_timeout_s=60))
        state = PointerState(P)
        while not state.held:  # published while the writer holds: the extension covers it
            state = await read_pointer(settings)
            await asyncio.sleep(0.1)
        for name in NAMES:
            await publish(settings, name, parts[name][1])
        outcome = await replay
        assert (outcome.switched, outcome.held, outcome.result.version) == (True, True, 1)
        for name in NAMES:  # after the switch: the writer publishes into version 1
            await publish(settings, name, parts[name][2])
        total = sum(len(e) for p in parts.values() for e in p)
        await _until("every event folded", lambda: writer.folded == total)
        return writer
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await follow.stop()


@pytest.mark.broker
def test_a_switched_version_keeps_receiving_every_change_from_the_live_writer(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    writer = asyncio.run(_handover_with_a_live_writer(settings))
    assert asyncio.run(active_version(settings)).version == 1
    assert asyncio.run(derived_conversations(settings)) == _expected()
    v1 = asyncio.run(active_version(settings)).topic
    assert writer.published.get(v1, 0) > 0  # the writer went on in version 1...
    old = asyncio.run(read_conversations(settings, settings.topics.derived_messages))
    assert old != _expected()  # ...and stopped publishing to version 0
    state = asyncio.run(read_pointer(settings))
    assert (state.pending(), state.writers, state.held) == (None, {}, {})  # all withdrawn
    pointer = state.active
    assert pointer is not None and set(pointer.covered) <= set(range(settings.partitions))
    # Both versions hold every change in its session's partition (version 0: never
    # written when the writer started; version 1: rebuilt, then written live).
    assert state.layout_of(settings.topics.derived_messages) == "session"
    assert state.layout_of(v1) == "session"
    for topic in (settings.topics.derived_messages, v1):
        assert asyncio.run(misplaced_changes(settings, topic)) == (True, [])


@pytest.mark.broker
def test_a_handover_nobody_answers_is_withdrawn_and_nothing_switches(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)

    async def scenario() -> None:
        await ensure_topics(settings)
        await publish(settings, "text-turn", _split("text-turn")[0])
        # A writer registered by a worker that crashed: it never answers.
        await write_pointer(settings, {writer_key(P, "crashed"): {"worker": "crashed"}})
        with pytest.raises(BrokerError, match=r"held partitions \[0, 1, 2\].*'crashed'"):
            await replay_projection(settings, SERDE.decode, handover_timeout_s=1.5)

    asyncio.run(scenario())
    state = asyncio.run(read_pointer(settings))
    assert state.active is None and state.pending() is None
    assert asyncio.run(active_version(settings)).version == 0


@pytest.mark.broker
def test_the_processors_publish_into_the_version_replay_switched_to(
        kafka_bootstrap: str, topic_prefix: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from processors_support import Worker, free_port

    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    parts = {name: _split(name) for name in NAMES}

    async def publish_part(index: int) -> None:
        await ensure_topics(settings)
        for name in NAMES:
            await publish(settings, name, parts[name][index])

    def folded(upto: int) -> None:
        for name in NAMES:
            count = sum(len(p) for p in parts[name][:upto + 1])
            worker.wait_for(f"{name} folded", lambda n=name, c=count: worker.get(
                f"/sessions/{n}/messages")[1].get("nextSeq") == c)

    asyncio.run(publish_part(0))
    for key, value in {"DSH_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
                       "DSH_TOPIC_PREFIX": settings.topic_prefix,
                       "DSH_PARTITIONS": str(settings.partitions)}.items():
        monkeypatch.setenv(key, value)
    worker = Worker(settings, free_port(), tmp_path / "processors")
    try:
        worker.wait_ready()
        folded(0)
        assert worker.get("/health")[1]["projection"]["version"] == 0
        assert main(["replay"]) == 0
        summary = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert (summary["switched"], summary["processors_held"]) == (True, True)
        asyncio.run(publish_part(1))
        asyncio.run(publish_part(2))
        folded(2)
        projection = worker.get("/health")[1]["projection"]
        assert (projection["version"], projection["holding"]) == (1, None)
    finally:
        worker.stop()
    assert asyncio.run(derived_conversations(settings)) == _expected()
    v1 = asyncio.run(active_version(settings)).topic
    for topic in (settings.topics.derived_messages, v1):   # the processors' and replay's
        assert asyncio.run(misplaced_changes(settings, topic)) == (True, [])


@pytest.mark.broker
def test_a_version_0_written_before_layouts_keeps_the_key_layout(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    """A worker finding version 0 already written (by code older than layouts: by key)
    names the key layout for it and keeps publishing by key: moving a key to another
    partition would leave its older value there, beside the newer one, for good."""
    settings = fanout_settings(kafka_bootstrap, topic_prefix)

    async def scenario() -> tuple[str | None, int | None]:
        await ensure_topics(settings)
        async with BulkProducer(settings) as out:   # what an older worker left
            await out.send(settings.topics.derived_messages, b"s/000000000000", None)
        follow = ProjectionFollow(settings, "late", lambda: range(settings.partitions))
        await follow.start()
        try:
            return follow.state.layouts.get(follow.active.topic), follow.partition_of(1)
        finally:
            await follow.stop()

    assert asyncio.run(scenario()) == ("key", None)


def test_a_worker_id_must_be_a_single_key_segment() -> None:
    settings = Settings.from_env({}, bootstrap_servers="127.0.0.1:1", topic_prefix="t.")
    with pytest.raises(ValueError, match="without '/'"):
        ProjectionFollow(settings, "app/host", lambda: ())
    follow = ProjectionFollow(settings, "app@host:6066", lambda: ())
    assert follow.active == ActivePointer(0, "t.derived-messages")  # before any pointer
    assert follow.topic_for(0, 0) == "t.derived-messages"


def test_a_follower_that_could_not_start_refuses_to_route() -> None:
    settings = Settings.from_env({}, bootstrap_servers="127.0.0.1:1", topic_prefix="t.")
    follow = ProjectionFollow(settings, "w", lambda: ())

    async def scenario() -> None:
        with pytest.raises(BrokerError):
            await follow.start()  # nothing listens on port 1
        with pytest.raises(BrokerError, match="could not be read at start"):
            await follow.gate(0, 0)

    asyncio.run(scenario())


async def misplaced_changes(settings: Settings, topic: str) -> tuple[bool, list[str]]:
    """Whether ``topic`` holds records, and those not in their session's partition."""
    wrong: list[str] = []
    async with TopicScan(settings, topic) as scan:
        async for run in scan.client_batches():
            for record in run:
                session_id = (record.key or b"").decode().rpartition("/")[0]
                if record.partition != partition_for(session_id, settings.partitions):
                    wrong.append(f"{record.key!r}@{record.partition}")
        return scan.total > 0, wrong

