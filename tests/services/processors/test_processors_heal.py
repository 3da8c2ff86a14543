"""A worker whose state is behind a valid log heals the session from the log (issue 31).

The log is right: when a worker meets a record of a session it has no state for (and the
record is not seq 0), or a seq past the one its state expects, it reads the session's
missing records back and folds them, instead of dead-lettering valid events. Only records
that are themselves invalid, or a log that really has a hole, are dead-lettered.

No broker: the tables are dicts and the log is a list read back as the worker's
``read_back`` reads the session topic (``tests/adapters/test_processors_session_span.py`` runs that
reader against the broker).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from folding_support import TOPICS, Harness, sessions

from pipeline.adapters.kafka.records import InboxRecord
from pipeline.adapters.kafka.session_span import record_seq
from pipeline.core.errors import BrokerError
from pipeline.core.events import Event, Replace
from pipeline.core.log import derive_messages
from pipeline.services.processors.folding import SessionFolder
from pipeline.services.processors.session_state import SessionTables


class LogHarness(Harness):
    """A worker whose ``read_back`` reads the records written so far (the session topic)."""

    def __init__(self, log: list[InboxRecord] | None = None) -> None:
        super().__init__()
        self.log: list[InboxRecord] = [] if log is None else log
        self.reads = 0
        self.folder.read_back = self.read_back

    def record(self, session_id: str, event: Event) -> InboxRecord:
        written = super().record(session_id, event)
        self.log.append(written)
        return written

    async def read_back(self, partition: int, session_id: str, from_seq: int,
                        before_offset: int) -> Sequence[InboxRecord]:
        self.reads += 1
        found: dict[int, InboxRecord] = {}
        for written in self.log:
            seq = record_seq(written)
            if (written.key == session_id.encode() and written.offset < before_offset
                    and seq is not None and seq >= from_seq):
                found.setdefault(seq, written)
        return [found[seq] for seq in sorted(found)]


def forgotten(harness: LogHarness) -> LogHarness:
    """A worker on the same log whose tables lost everything (seed 22142's worker)."""
    again = LogHarness(harness.log)
    again.offset = harness.offset
    return again


def dead_letters(harness: Harness) -> list[str]:
    return [dict(o.headers)["dsh.error.message"].decode()
            for o in harness.sent_to(TOPICS.dlq(TOPICS.session_events))]


async def test_a_session_the_worker_forgot_is_rebuilt_from_the_log() -> None:
    harness = LogHarness()
    (sid, events), = sessions(4, 1).items()
    records = [harness.record(sid, e) for e in events]
    cut = len(records) // 2
    await harness.feed_batch(records[:cut])
    again = forgotten(harness)   # no state for the session: its next record is seq ``cut``
    await again.feed_batch(records[cut:])
    assert dead_letters(again) == []
    assert again.counters.gaps == 0
    assert again.counters.sessions_healed == 1 and again.counters.records_healed == cut
    assert again.messages(sid) == list(derive_messages(events))


async def test_a_state_behind_the_log_is_brought_up_to_it() -> None:
    harness = LogHarness()
    (sid, events), = sessions(7, 1).items()
    records = [harness.record(sid, e) for e in events]
    behind, cut = len(records) // 3, 2 * len(records) // 3
    await harness.feed_batch(records[:behind])
    stale = LogHarness(harness.log)   # tables as of ``behind``, committed offset at ``cut``
    stale.tables = SessionTables(dict(harness.tables.sessions), dict(harness.tables.nodes),
                                 dict(harness.tables.chunk_marks))
    stale.folder = SessionFolder(stale.tables, stale._send, harness.folder.decode, TOPICS,
                                 "t.by-model", stale.counters, read_back=stale.read_back)
    await stale.feed_batch(records[cut:])
    assert dead_letters(stale) == []
    assert stale.counters.records_healed == cut - behind
    assert stale.messages(sid) == list(derive_messages(events))


async def test_a_hole_in_the_log_itself_is_still_a_dead_lettered_gap() -> None:
    harness = LogHarness()
    (sid, events), = sessions(5, 1).items()
    records = [harness.record(sid, e) for e in events]
    del harness.log[5]   # seq 5 never reached the topic
    await harness.feed(records[:5] + records[6:])
    assert harness.counters.sessions_healed == 0
    letters = dead_letters(harness)
    assert len(letters) == harness.counters.gaps == len(records) - 6
    assert "expected seq 5, found 6 (gap)" in letters[0]
    assert harness.messages(sid) == list(derive_messages(events[:5]))


async def test_a_session_stopped_at_an_invalid_event_is_not_read_back() -> None:
    harness = LogHarness()
    msg = {"id": "u", "role": "user", "content": [{"type": "text", "text": "x"}]}
    good = Event("user/message", 0, 0, msg, "append")
    bad = Event("user/message", 1, 0, msg, Replace(7, 7), (0,))
    after = Event("user/message", 2, 0, msg, "append")
    await harness.feed([harness.record("s", e) for e in (good, bad, after)])
    assert harness.reads == 0 and harness.counters.sessions_healed == 0
    assert harness.counters.invalid_events == 1 and harness.counters.gaps == 1
    # A worker that lost the session re-folds up to the invalid event, dead-letters nothing
    # it reads back (handled when first folded), and stops there again.
    again = forgotten(harness)
    await again.feed([again.record("s", Event("user/message", 3, 0, msg, "append"))])
    assert again.counters.sessions_healed == 0 and again.messages("s") == [msg]
    assert [m.split(":")[0] for m in dead_letters(again)] == ["seq 3, type 'user/message'"]


async def test_a_failed_read_back_fails_the_batch_and_dead_letters_nothing() -> None:
    harness = LogHarness()
    (sid, events), = sessions(4, 1).items()
    records = [harness.record(sid, e) for e in events]
    again = forgotten(harness)

    async def unreachable(*_: object) -> Sequence[InboxRecord]:
        raise BrokerError("read back: the broker is down")

    again.folder.read_back = unreachable
    with pytest.raises(BrokerError):
        await again.folder.handle_batch(records[3:])
    assert dead_letters(again) == [] and again.counters.gaps == 0
