"""The projection pointer read through one consumer kept open (``PointerReader``), and the
processors' follower on it (``ProjectionFollow`` between start and stop), on the real broker.

Each read returns the records up to the end offsets listed when it was called, each record
once; a started follower's refresh sees every record written before it, answers a request,
and never passes over a malformed record.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fanout_support import fanout_settings

from pipeline.adapters.kafka.projection_follow import ProjectionFollow
from pipeline.adapters.kafka.projection_pointer import (
    PointerReader,
    read_pointer_state,
    write_pointer_records,
)
from pipeline.core.errors import EventError
from pipeline.core.projection import (
    ActivePointer,
    HandoverRequest,
    HeldBy,
    handover_key,
    writer_key,
)

P = "derived-messages"
pytestmark = pytest.mark.broker


def _values(records: list[tuple[bytes | None, bytes | None]]) -> list[tuple[str, object]]:
    return [(key.decode() if key else "", None if value is None else json.loads(value))
            for key, value in records]


def test_each_read_returns_the_records_up_to_the_ends_listed_when_it_is_called(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)

    async def scenario() -> list[list[tuple[str, object]]]:
        await write_pointer_records(settings, {"a": {"n": 1}})
        reads = []
        async with PointerReader(settings) as reader:
            await write_pointer_records(settings, {"b": {"n": 2}})   # past the start's ends
            reads.append(_values(await reader.read_to_now()))
            reads.append(_values(await reader.read_to_now()))
            reads.append(_values(await reader.read_to_now()))
            await write_pointer_records(settings, {"a": {"n": 3}, "b": None})
            reads.append(_values(await reader.read_to_now()))
        return reads

    first, second, third, fourth = asyncio.run(scenario())
    assert first == [("a", {"n": 1})]
    assert second == [("b", {"n": 2})]
    assert third == []
    assert sorted(fourth, key=lambda kv: kv[0]) == [("a", {"n": 3}), ("b", None)]


def test_a_wait_ends_when_a_record_is_fetched_or_when_woken(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)

    async def scenario() -> list[tuple[str, object]]:
        await write_pointer_records(settings, {"a": {"n": 1}})
        async with PointerReader(settings) as reader:
            await reader.read_to_now()
            wake = asyncio.Event()
            wake.set()
            await asyncio.wait_for(reader.wait(600, wake), 60)   # woken: returns at once
            writing = asyncio.get_running_loop().create_task(
                write_pointer_records(settings, {"c": {"n": 4}}))
            await asyncio.wait_for(reader.wait(600, asyncio.Event()), 60)  # the record
            await writing
            return _values(await reader.read_to_now())

    assert asyncio.run(scenario()) == [("c", {"n": 4})]


def test_a_started_follower_refreshes_to_every_record_written_before_and_answers(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    follow = ProjectionFollow(settings, "w1", lambda: {0, 2}, poll_s=600, holding_poll_s=600)
    request = HandoverRequest(1, f"{topic_prefix}derived-messages.v1", "r-1")

    async def scenario() -> tuple[object, ...]:
        await follow.start()
        try:
            await write_pointer_records(settings, {handover_key(P): request.to_json()})
            await follow.refresh()
            seen = follow.state.pending()
            answered = (await read_pointer_state(settings)).held.get("w1")
            switch = ActivePointer(1, request.topic, 0, {0: 5})
            await write_pointer_records(settings, {P: switch.to_json(P)})
            await write_pointer_records(settings, {handover_key(P): None})
            await follow.refresh()
            after = (follow.state.pending(), follow.active)
            gate = await asyncio.wait_for(follow.gate(0, 7), 60)
        finally:
            await follow.stop()
        state = await read_pointer_state(settings)
        return seen, answered, after, gate, state.writers, state.held

    seen, answered, after, gate, writers, held = asyncio.run(scenario())
    assert seen == request
    assert answered == HeldBy("r-1", frozenset({0, 2}))
    assert after == (None, ActivePointer(1, request.topic, 0, {0: 5}))
    assert gate == request.topic
    assert (writers, held) == ({}, {})   # withdrawn at stop


def test_a_started_follower_never_passes_over_a_malformed_record(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    follow = ProjectionFollow(settings, "w1", lambda: {0}, poll_s=600, holding_poll_s=600)

    async def scenario() -> list[str]:
        await follow.start()
        errors = []
        try:
            await write_pointer_records(settings, {writer_key(P, "w9"): ["not", "an object"]})
            for _ in range(2):   # a failed read starts over: the record is read again
                with pytest.raises(EventError) as caught:
                    await follow.refresh()
                errors.append(str(caught.value))
        finally:
            await follow.stop()
        return errors

    errors = asyncio.run(scenario())
    assert len(errors) == 2 and all("writer/w9" in error for error in errors)
