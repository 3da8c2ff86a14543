"""The batching consumer (:mod:`pipeline.adapters.faust.transport`): what a batch's span
covers, and when, in a rebalance, it has the folds forget what they cached (faust's own
rebalance chain replaced by a recorder: the real one runs on the broker in
``test_processors_failover.py`` and ``test_scale_out.py``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.transport.drivers.aiokafka import ensure_aiokafka_TP
from faust.types import TP

from pipeline.adapters.faust import transport
from pipeline.adapters.faust.transport import (
    RecordBatch,
    awaiting_recovery_seek,
    fetch_again,
)
from pipeline.codec.avro import EventSerde
from pipeline.services.processors.app import build_processors
from pipeline.settings import Settings


def _span(records: list[int], span: tuple[int | None, int | None]) -> tuple[int, int]:
    batch = RecordBatch([SimpleNamespace(offset=o) for o in records], span)
    return batch.start, batch.end


def test_a_batch_span_must_contain_its_records_or_the_records_are_the_span() -> None:
    assert _span([11, 12], (10, 14)) == (10, 14)
    assert _span([11, 12], (None, None)) == (11, 13)
    # A position read after a seek elsewhere cannot claim offsets the records do not reach.
    assert _span([11, 12], (12, 12)) == (11, 13)


async def test_a_rebalance_forgets_and_prepares_before_faust_with_the_partitions_paused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The folds' cache is dropped and the projection pointer re-read at the start of an
    assignment, before faust's chain (whose table recovery resumes the partitions; its
    signal came after their first batches were folded, and dropped them for good); on a
    revoke the cache is dropped after the persist."""
    processors = build_processors(Settings.from_env({}), EventSerde().decode)
    consumer = processors.app.consumer
    session_tp = TP(processors.settings.topics.session_events, 3)
    other_tp = TP("some-changelog", 3)
    seen: list[tuple[str, bool]] = []

    class Recorder:   # an executor's part of a rebalance (adapters/faust/executor.py)
        async def forget(self) -> None:
            seen.append(("forget", session_tp in consumer._paused_partitions))

        async def persist(self) -> None:
            seen.append(("persist", False))

        async def assigned(self) -> None:
            seen.append(("reread pointer", session_tp in consumer._paused_partitions))

    async def faust_assigned(self: Any, assigned: Any, generation_id: int = 0) -> None:
        seen.append(("faust assigned", session_tp in self._paused_partitions))

    async def faust_revoked(self: Any, revoked: Any) -> None:
        seen.append(("faust revoked", False))

    monkeypatch.setattr(AIOKafkaConsumer, "on_partitions_assigned", faust_assigned)
    monkeypatch.setattr(AIOKafkaConsumer, "on_partitions_revoked", faust_revoked)
    executors = processors.app.transport.executors
    assert set(executors) == {processors.settings.topics.session_events,
                              processors.options.usage_topic(processors.settings)}
    executors.clear()
    executors["folds"] = Recorder()

    await consumer.on_partitions_assigned({session_tp, other_tp}, 3)
    assert seen == [("forget", True), ("reread pointer", True), ("faust assigned", True)]
    assert other_tp not in consumer._paused_partitions   # only batched topics
    seen.clear()
    await consumer.on_partitions_revoked({session_tp, other_tp})
    assert [step for step, _ in seen] == ["persist", "forget", "faust revoked"]


async def test_batched_partitions_resumed_before_the_recovery_seek_wait_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """faust's recovery resumes the stream partitions, with the flow running, and only then
    seeks them to the committed offsets: a batch handed out in between would be fetched
    again by the seek (folded twice). Batched partitions resume when the seek is done (or
    failed); later pauses and resumes (a stream buffer filling and draining) are faust's
    again."""
    processors = build_processors(Settings.from_env({}), EventSerde().decode)
    consumer = processors.app.consumer
    session_tp = TP(processors.settings.topics.session_events, 1)
    other_tp = TP("some-changelog", 1)

    async def faust_assigned(self: Any, assigned: Any, generation_id: int = 0) -> None:
        pass

    async def faust_seek(self: Any) -> None:
        self._committed_offset[session_tp] = 604   # committed: no seek to the beginning

    monkeypatch.setattr(AIOKafkaConsumer, "on_partitions_assigned", faust_assigned)
    monkeypatch.setattr(AIOKafkaConsumer, "perform_seek", faust_seek)
    monkeypatch.setattr(consumer, "assignment", lambda: {session_tp, other_tp})

    def active() -> set[TP]:
        return {tp for tp in (session_tp, other_tp) if tp in consumer._get_active_partitions()}

    await consumer.on_partitions_assigned({other_tp}, 2)   # nothing batched: no seek due
    assert not awaiting_recovery_seek(processors.app)
    await consumer.on_partitions_assigned({session_tp, other_tp}, 3)
    consumer.resume_partitions({session_tp, other_tp})   # recovery, before its seek
    assert active() == {other_tp}
    assert awaiting_recovery_seek(processors.app)   # /health: still in recovery
    assert processors.recovery()["in_recovery"]
    await consumer.perform_seek()
    assert active() == {session_tp, other_tp}
    assert not awaiting_recovery_seek(processors.app)
    consumer.pause_partitions({session_tp})
    consumer.resume_partitions({session_tp})
    assert active() == {session_tp, other_tp}

    async def failing_seek(self: Any) -> None:
        raise RuntimeError("the broker timed out")

    monkeypatch.setattr(AIOKafkaConsumer, "perform_seek", failing_seek)
    await consumer.on_partitions_assigned({session_tp, other_tp}, 4)
    consumer.resume_partitions({session_tp, other_tp})
    with pytest.raises(RuntimeError):
        await consumer.perform_seek()
    assert active() == {session_tp, other_tp}   # a failed seek never leaves one paused


def test_the_usage_sums_are_kept_only_between_rebalances() -> None:
    """faust's consumer thread marks a rebalance (``app.rebalancing``) before it asks for
    the new assignment, and its assignor shows the new partitions before faust's
    ``on_partitions_assigned`` reaches the event loop, so before the recovery starts (none
    under way, no seek pending): from that start to the end of the recovery the tables are
    not settled, and the usage sums built meanwhile are not kept (a takeover kept sums then
    that missed what the recovery wrote, for good). Each rebalance leaves a settled state
    of its own."""
    processors = build_processors(Settings.from_env({}), EventSerde().decode)
    app, aggregator = processors.app, processors.aggregator
    assert aggregator is not None
    before = processors.tables_epoch()
    assert before is not None
    app.on_rebalance_start()   # faust's consumer thread, first thing in a rebalance
    assert not processors.recovery()["in_recovery"]   # its recovery not even started
    assert aggregator.epoch() is None
    aggregator.current_sums()
    assert aggregator.sums.partitions is None   # built for the answer, not kept
    app.on_rebalance_end()   # after the recovery and the seek
    after = aggregator.epoch()
    assert after is not None and after != before
    assert aggregator.current_sums() is aggregator.sums
    assert aggregator.sums.epoch == after


async def test_a_failed_batch_is_read_again_from_the_committed_offset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 10: after a failed batch nothing of its partition is folded until it is read
    again from its committed offset (never below its first offset); the failures in a row
    are counted until one of its batches is folded; a rebalance meanwhile cancels the
    seek (the new assignment reads every partition from its committed offset)."""
    monkeypatch.setattr(transport, "FETCH_AGAIN_DELAY_S", 0.0)
    processors = build_processors(Settings.from_env({}), EventSerde().decode)
    app, consumer = processors.app, processors.app.consumer
    session_tp = TP(processors.settings.topics.session_events, 2)
    seeks: list[dict[Any, int]] = []
    first = {session_tp: 0}

    async def earliest(*tps: Any) -> dict[Any, int]:
        return {tp: first[tp] for tp in tps}

    async def seek_wait(offsets: dict[Any, int]) -> None:
        seeks.append(dict(offsets))

    monkeypatch.setattr(consumer, "assignment", lambda: {session_tp})
    monkeypatch.setattr(consumer, "earliest_offsets", earliest)
    monkeypatch.setattr(consumer, "_new_consumer_thread", lambda: None)
    consumer.poll_thread = SimpleNamespace(seek_wait=seek_wait)
    consumer._committed_offset[session_tp] = 604

    def batch(start: int, end: int) -> Any:
        message = SimpleNamespace(tp=session_tp, topic=session_tp.topic, offset=end - 1,
                                  span=(start, end), records=[],
                                  generation_id=app.consumer_generation_id)
        message.delivery = consumer._ledger.handed_over(session_tp.topic, session_tp,
                                                        end - 1, start)
        return message

    assert fetch_again(app, session_tp.topic, 5) == 0          # not this worker's
    assert fetch_again(app, session_tp.topic, 2) == 1
    later = batch(700, 720)
    assert not consumer.record_received(later)                  # would be a gap
    await asyncio.gather(*consumer._seeks)
    assert seeks == [{ensure_aiokafka_TP(session_tp): 604}]
    assert not consumer.record_received(batch(720, 740))        # fetched before the seek
    again = batch(604, 720)
    assert consumer.record_received(again)                      # the records read again
    assert fetch_again(app, session_tp.topic, 2) == 2           # failed again: in a row
    await asyncio.gather(*consumer._seeks)
    assert consumer.record_received(batch(604, 720))
    consumer.record_folded(again)
    first[session_tp] = 650                                     # retention passed the commit
    assert fetch_again(app, session_tp.topic, 2) == 1           # the count starts again
    await asyncio.gather(*consumer._seeks)
    assert seeks[-1] == {ensure_aiokafka_TP(session_tp): 650}

    monkeypatch.setattr(transport, "FETCH_AGAIN_DELAY_S", 0.05)
    fetch_again(app, session_tp.topic, 2)
    app.consumer_generation_id += 1                             # a rebalance came
    await asyncio.gather(*consumer._seeks)
    assert len(seeks) == 3


async def test_a_commit_the_broker_refused_leaves_the_batched_offsets_as_they_were(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 3: faust records the offsets of a commit as committed whether or not the broker
    took them (a commit refused because the group rebalanced meanwhile), and would never
    commit a batched partition again up to there. A refused commit changes nothing of the
    batched partitions; the others keep faust's behaviour."""
    processors = build_processors(Settings.from_env({}), EventSerde().decode)
    consumer = processors.app.consumer
    session_tp = TP(processors.settings.topics.session_events, 1)
    other_tp = TP("some-changelog", 1)
    broker_takes: list[bool] = [False]

    async def faust_commit(self: Any, offsets: Any) -> bool:
        return broker_takes[0]

    monkeypatch.setattr(AIOKafkaConsumer, "_commit", faust_commit)
    monkeypatch.setattr(consumer, "assignment", lambda: {session_tp, other_tp})
    consumer._committed_offset[session_tp] = 604
    consumer._committed_offset[other_tp] = 10
    assert not await consumer._commit_offsets({session_tp: 700, other_tp: 20})
    assert consumer._committed_offset[session_tp] == 604
    assert consumer._committed_offset[other_tp] == 20   # faust's own bookkeeping
    broker_takes[0] = True
    assert await consumer._commit_offsets({session_tp: 700, other_tp: 30})
    assert consumer._committed_offset[session_tp] == 700
    assert consumer._committed_offset[other_tp] == 30
