"""What the batching consumer commits (pure part of :mod:`pipeline.services.processors.transport`):
the end of the run of folded spans that starts at the committed offset; and when, in a
rebalance, it has the folds forget what they cached (faust's own rebalance chain replaced by
a recorder: the real one runs on the broker in ``test_processors_failover.py`` and
``test_scale_out.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.types import TP

from pipeline.codec.avro import EventSerde
from pipeline.services.processors.app import build_processors
from pipeline.services.processors.transport import (
    RecordBatch,
    awaiting_recovery_seek,
    before_assignment,
    committable,
    forget_on_rebalance,
    persist_before_commit,
)
from pipeline.settings import Settings

# Offset 10 is a transaction marker: the batch 0..9 drained it (span end 11), so the next
# batch's span starts at 11.
SPANS = [(0, 5), (5, 11), (11, 21), (21, 32)]


def test_folded_spans_in_order_commit_past_the_last() -> None:
    assert committable(SPANS[:2], None) == 11
    assert committable(SPANS[2:], 11) == 32


def test_a_span_not_folded_holds_back_every_later_one() -> None:
    # Batch 5..9 is still being folded, failed, was skipped or lost: nothing past 4.
    assert committable([SPANS[0], *SPANS[2:]], None) == 5
    assert committable(SPANS[2:], 5) is None


def test_a_span_that_starts_at_a_marker_commits_from_the_committed_offset() -> None:
    # Committed at 10 (the marker) by an earlier owner; the fetch from 10 skipped it.
    assert committable([(10, 21)], 10) == 21
    # Starting at the first record (11) would leave a hole after the commit for good.
    assert committable([(11, 21)], 10) is None


def test_a_drain_that_handed_out_only_a_marker_fills_the_hole() -> None:
    # Committed 36; aiokafka drained the marker at 36 with no record, then 37..38.
    assert committable([(37, 39)], 36) is None
    assert committable([(37, 39), (36, 37)], 36) == 39


def test_spans_already_committed_and_overlapping_spans_never_move_the_commit_back() -> None:
    assert committable([(5, 11)], 30) is None
    assert committable([(0, 11), (5, 21)], 0) == 21


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

    async def forget() -> None:
        seen.append(("forget", session_tp in consumer._paused_partitions))

    async def persist() -> None:
        seen.append(("persist", False))

    async def reread_pointer() -> None:
        seen.append(("reread pointer", session_tp in consumer._paused_partitions))

    async def faust_assigned(self: Any, assigned: Any, generation_id: int = 0) -> None:
        seen.append(("faust assigned", session_tp in self._paused_partitions))

    async def faust_revoked(self: Any, revoked: Any) -> None:
        seen.append(("faust revoked", False))

    monkeypatch.setattr(AIOKafkaConsumer, "on_partitions_assigned", faust_assigned)
    monkeypatch.setattr(AIOKafkaConsumer, "on_partitions_revoked", faust_revoked)
    forget_on_rebalance(processors.app, "folds", forget)
    forget_on_rebalance(processors.app, "folds", forget)   # idempotent by name
    persist_before_commit(processors.app, "folds", persist)
    before_assignment(processors.app, "pointer", reread_pointer)

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
