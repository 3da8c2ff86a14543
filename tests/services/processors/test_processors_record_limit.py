"""A session whose table record would outgrow the producer's record limit stops there, alone.

No broker: the record limit is the folder's ``max_record_bytes`` (the worker passes faust's
``producer_max_request_size``). Written anyway, such a record would be refused at the next
commit and stop every later table write of the worker (faust's producer buffer dies).
"""

from __future__ import annotations

import random

from folding_support import TOPICS, Harness, sessions
from processors_support import SessionBuilder

from pipeline.adapters.kafka.records import InboxRecord
from pipeline.core.events import Event, dumps_json
from pipeline.core.log import derive_messages
from pipeline.services.processors.session_state import (
    SessionState,
    kept_chars_after,
    record_bytes_bound,
)


def long_session(turns: int) -> list[Event]:
    builder = SessionBuilder(random.Random(41), "p", "a", 1_800_000_000_000, max_chunks=3)
    for turn in range(1, turns + 1):
        builder.turn(turn)
    return builder.events


def record_bytes(harness: Harness, session_id: str) -> int:
    return len(dumps_json(harness.tables.sessions[session_id]).encode())


async def test_the_bound_is_above_the_record_at_every_event() -> None:
    harness = Harness()
    events = long_session(12)
    for event in events:
        record = harness.record("s", event)
        state = harness.folder.current("s") or SessionState("s")
        bound = record_bytes_bound(state, event.seq, kept_chars_after(state, event))
        await harness.feed([record])
        assert record_bytes(harness, "s") <= bound


async def test_a_session_outgrowing_the_record_limit_stops_there_alone() -> None:
    events = long_session(400)
    probe = Harness()
    await probe.feed_batch([probe.record("long", e) for e in events])
    limit = record_bytes(probe, "long") // 2
    (short_id, short), = sessions(32, 1).items()

    harness = Harness()
    harness.folder.max_record_bytes = limit
    await harness.feed_batch([*(harness.record("long", e) for e in events),
                              *(harness.record(short_id, e) for e in short)])
    written = harness.tables.sessions["long"]
    assert record_bytes(harness, "long") <= limit
    assert written["stalled"] and 0 < written["next"] < len(events)
    # Folded up to the refused event, exactly as core derives that prefix; never past it.
    assert harness.messages("long") == list(derive_messages(events[:written["next"]]))
    assert harness.counters.invalid_events == 1
    assert harness.counters.gaps == len(events) - written["next"] - 1
    refused = [dict(o.headers) for o in harness.sent_to(TOPICS.dlq(TOPICS.session_events))
               if dict(o.headers)["dsh.error.class"] == b"EventError"]
    assert len(refused) == 1
    assert b"session-record-size" in refused[0]["dsh.error.message"]
    assert f"{limit:,}-byte record limit".encode() in refused[0]["dsh.error.message"]
    # The other session of the batch is folded in full.
    assert harness.messages(short_id) == list(derive_messages(short))


async def test_a_large_message_that_fits_the_limit_is_folded() -> None:
    """The bound is a quick test first (an event's bytes may all become kept strings); an
    event that fails it is measured for what the records really keep before any refusal."""
    harness = Harness()
    text = {"type": "text", "text": "x" * 400_000}
    message = {"id": "u0", "role": "user", "content": [text], "source": {"kind": "user"}}
    events = [Event("user/message", 0, 0, message, "append")]
    await harness.feed([harness.record("big", e) for e in events])
    assert harness.counters.invalid_events == 0
    assert harness.messages("big") == [message]
    assert record_bytes(harness, "big") < 2_000


async def test_a_message_above_the_limit_stops_its_session_alone() -> None:
    harness = Harness()
    text = {"type": "text", "text": '"' * 600_000}   # JSON doubles it: 1.2 MB
    message = {"id": "u0", "role": "user", "content": [text], "source": {"kind": "user"}}
    (short_id, short), = sessions(35, 1).items()
    await harness.feed([harness.record("big", Event("user/message", 0, 0, message, "append")),
                        *(harness.record(short_id, e) for e in short)])
    assert harness.counters.invalid_events == 1
    (letter,) = harness.sent_to(TOPICS.dlq(TOPICS.session_events))
    assert b"message-record-size" in dict(letter.headers)["dsh.error.message"]
    assert "big/0" not in harness.tables.nodes
    assert harness.messages(short_id) == list(derive_messages(short))


async def test_a_dead_letter_above_the_limit_names_its_original_instead_of_carrying_it(
        ) -> None:
    harness = Harness()
    harness.folder.max_record_bytes = 50_000
    garbage = InboxRecord(TOPICS.session_events, 1, 5, b"s", b"\xc3\x01" + b"?" * 60_000, ())
    await harness.feed([garbage])
    (letter,) = harness.sent_to(TOPICS.dlq(TOPICS.session_events))
    headers = dict(letter.headers)
    assert letter.value == b"" and headers["dsh.original.omitted"] == b"60002 bytes"
    assert (headers["dsh.original.partition"], headers["dsh.original.offset"]) == (b"1", b"5")
