"""The processors' pure batch step: a batch of records -> a plan, with plain dicts as tables.

:func:`pipeline.services.processors.planning.plan_batch` never awaits and never writes a
table; what it returns, performed, is what the worker folds (the folder's tests cover the
performing, ``tests/services/processors/test_processors_folding.py``).
"""

from __future__ import annotations

import inspect
import json

from folding_support import SERDE, TOPICS, Harness, sessions

from pipeline.adapters.kafka.records import InboxRecord
from pipeline.codec.outputs import default_output_codecs
from pipeline.core.errors import CodecError, SequenceError
from pipeline.core.log import derive_messages
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.planning import (
    FoldState,
    ReadBack,
    continue_plan,
    plan_batch,
)
from pipeline.services.processors.session_state import SessionState, SessionTables


def fold_state(tables: SessionTables | None = None, *, can_heal: bool = False) -> FoldState:
    return FoldState(tables or SessionTables({}, {}, {}), SERDE.decode, TOPICS, "t.by-model",
                     default_output_codecs(), DeliveryCounters(), 8 << 20, can_heal=can_heal)


def one_session(seed: int = 4) -> tuple[str, list[InboxRecord]]:
    harness = Harness()
    (sid, events), = sessions(seed, 1).items()
    return sid, [harness.record(sid, e) for e in events]


def test_the_batch_step_is_synchronous() -> None:
    assert not inspect.iscoroutinefunction(plan_batch)
    assert not inspect.iscoroutinefunction(continue_plan)


def test_a_plan_holds_the_batch_s_writes_and_writes_no_table() -> None:
    sid, records = one_session()
    state = fold_state()
    plan = plan_batch(state, records)
    assert plan.done and plan.span == (records[0].offset, records[-1].offset + 1)
    assert state.tables == SessionTables({}, {}, {})          # nothing written
    nodes: dict[str, object] = {}
    for key, node in plan.node_writes:                         # performed on a plain dict
        if node is None:
            nodes.pop(key, None)
        else:
            nodes[key] = node
    folded = plan.states[sid]
    assert sid in plan.dirty and plan.cursors == {sid: folded.next_seq} == {sid: len(records)}
    messages = [nodes[f"{sid}/{seq}"]["message"] for seq in folded.surface.seqs()]   # type: ignore[index]
    assert [m for m in messages if m is not None] == list(derive_messages(
        SERDE.decode(r.value or b"")[1] for r in records))
    assert plan.letters == []


def test_outputs_are_in_fold_order_then_the_last_values() -> None:
    _sid, records = one_session()
    plan = plan_batch(fold_state(), records)
    topics = [out.topic for out in plan.outputs]
    tail = [TOPICS.fleet, TOPICS.usage]
    assert topics[-2:] == tail and not set(topics[:-2]) & set(tail)
    assert set(topics[:-2]) == {TOPICS.derived_messages, "t.by-model"}


def test_a_batch_of_duplicates_plans_nothing() -> None:
    sid, records = one_session()
    state = fold_state()
    first = plan_batch(state, records)
    tables = SessionTables({sid: first.states[sid].to_json()}, {}, {})
    again = fold_state(tables)
    plan = plan_batch(again, records[3:])
    assert plan.outputs == [] and plan.node_writes == [] and plan.dirty == set()
    assert again.counters.duplicates == len(records) - 3


def test_chunks_move_the_cursor_only() -> None:
    sid, records = one_session()
    chunks = [r for r in records if (dict(r.headers or ()).get("dsh.type") ==
                                     b"assistant/chunk")]
    prefix = records[:records.index(chunks[0])]
    state = fold_state()
    plan = plan_batch(state, prefix)
    tables = SessionTables({sid: plan.states[sid].to_json()}, {}, {})
    after = fold_state(tables)
    run = [chunks[0]]
    plan = plan_batch(after, run)
    assert plan.cursors == {sid: len(prefix) + 1} and plan.dirty == set()
    assert plan.outputs == [] and after.counters.chunks_skipped_undecoded == 1


def test_a_gap_that_can_be_healed_wants_the_log_and_goes_on_with_it() -> None:
    sid, records = one_session()
    state = fold_state(can_heal=True)
    plan = plan_batch(state, records[5:])
    assert not plan.done and plan.outputs == [] and plan.letters == []
    assert plan.wants == ReadBack(0, sid, 0, records[5].offset, 5)
    continue_plan(state, plan, records[:5])
    assert plan.done and plan.letters == [] and plan.cursors == {sid: len(records)}
    assert state.counters.sessions_healed == 1 and state.counters.records_healed == 5


def test_a_gap_the_log_has_is_a_dead_letter_and_the_session_stops() -> None:
    sid, records = one_session()
    state = fold_state(can_heal=True)
    plan = plan_batch(state, records[5:])
    continue_plan(state, plan, records[:2])                   # the log has a hole at 2
    assert [record for record, _ in plan.letters] == records[5:]   # never folded past
    assert all(isinstance(error, SequenceError) for _, error in plan.letters)
    assert plan.states[sid].stalled and plan.cursors == {sid: 2}
    assert plan.done and state.counters.gaps == len(records) - 5


def test_without_a_reader_a_gap_is_reported_at_once() -> None:
    _sid, records = one_session()
    state = fold_state()
    plan = plan_batch(state, [records[0], records[2]])
    assert plan.done and plan.wants is None
    assert [r for r, _ in plan.letters] == [records[2]]


def test_an_undecodable_record_is_a_dead_letter_and_the_batch_goes_on() -> None:
    sid, records = one_session()
    bad = InboxRecord(TOPICS.session_events, 0, 0, b"x", b"not avro", ())
    state = fold_state()
    plan = plan_batch(state, [bad, *records])
    (record, error), = plan.letters
    assert record is bad and isinstance(error, CodecError)
    assert plan.cursors == {sid: len(records)}


def test_a_plan_s_states_serialise_to_the_session_records() -> None:
    sid, records = one_session()
    plan = plan_batch(fold_state(), records)
    record = plan.states[sid].to_json()
    assert SessionState.from_json(sid, json.loads(json.dumps(record))).to_json() == record
