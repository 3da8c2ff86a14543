"""The one executor of batch plans, on plain data: any planner, dict tables, collected sends.

The processors' session planner is one :class:`~pipeline.adapters.faust.executor.Planner`;
these tests use a tiny one whose plans the test writes by hand, so what the executor does
with a plan (and in which order) is seen apart from how a plan is made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from pipeline.adapters.faust.executor import PlanExecutor
from pipeline.adapters.faust.pending import PendingWrites
from pipeline.adapters.kafka.dlq_book import DeadLetterBook
from pipeline.adapters.kafka.records import InboxRecord, OutRecord
from pipeline.core.errors import BrokerError, CodecError


@dataclass(frozen=True)
class Wanted:
    partition: int
    session_id: str
    from_seq: int
    before_offset: int


@dataclass
class Record:
    next: int

    def to_json(self) -> Any:
        return {"next": self.next}


@dataclass
class Plan:
    partition: int
    span: tuple[int, int]
    wants: Wanted | None = None
    outputs: list[OutRecord] = field(default_factory=list)
    letters: list[tuple[Any, Exception]] = field(default_factory=list)
    node_writes: list[tuple[str, Any]] = field(default_factory=list)
    to_write: dict[str, Record] = field(default_factory=dict)
    marks: dict[str, int] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)

    def sessions(self) -> set[str]:
        return self.touched


@dataclass(frozen=True)
class Tables:
    sessions: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, Any] = field(default_factory=dict)
    chunk_marks: dict[str, Any] = field(default_factory=dict)


class HandPlanner:
    """Plans a batch of records ``(session, seq)`` as the test says: one output per record,
    the session's record to write, and, when ``want_first`` is set, a read of the log
    before the first record (the records read back become outputs too)."""

    def __init__(self, want_first: bool = False) -> None:
        self.tables = Tables()
        self.states: dict[str, Any] = {}
        self.cursors: dict[str, int] = {}
        self.want_first = want_first
        self.calls: list[str] = []

    def start(self, records: Sequence[Any]) -> Plan:
        self.calls.append("start")
        return Plan(records[0].partition, (records[0].offset, records[-1].offset + 1))

    def go_on(self, plan: Plan, found: Sequence[Any] | None = None) -> Plan:
        self.calls.append("go_on")
        if self.want_first and found is None:
            plan.node_writes.append(("s/0", {"message": "before the read"}))
            plan.wants = Wanted(plan.partition, "s", 0, plan.span[0])
            return plan
        plan.wants = None
        for seq in range(*plan.span):
            plan.outputs.append(OutRecord("out", b"s", str(seq).encode()))
        plan.to_write["s"] = Record(plan.span[1])
        plan.touched.add("s")
        self.states["s"] = self.cursors["s"] = plan.span[1]
        return plan


def records(first: int, count: int) -> list[InboxRecord]:
    return [InboxRecord("in", 0, offset, b"s", b"v", ()) for offset in range(first,
                                                                             first + count)]


def executor(planner: HandPlanner, sent: list[OutRecord]) -> PlanExecutor[Plan]:
    async def send(out: OutRecord) -> None:
        sent.append(out)

    @dataclass
    class Counts:
        dead_letters: int = 0
        dead_letters_skipped: int = 0
        failed_batches: int = 0

    counts = Counts()
    return PlanExecutor(planner, send, DeadLetterBook(counters=counts),
                        PendingWrites(counts, planner))


async def test_a_plan_is_performed_in_order_and_written_only_by_the_persist() -> None:
    planner, sent = HandPlanner(), list[OutRecord]()
    run = executor(planner, sent)
    await run.fold(records(10, 3), "batch-1")
    assert planner.calls == ["start", "go_on"]
    assert [out.value for out in sent] == [b"10", b"11", b"12"]   # the plan's order
    assert planner.tables.sessions == {}                            # kept pending
    assert run.pending.folded_to == {0: 12}
    outcome = await run.persist()
    assert outcome.folded == ["batch-1"] and outcome.given_up == []
    assert planner.tables.sessions == {"s": {"next": 13}}


async def test_a_plan_s_dead_letters_go_after_its_outputs() -> None:
    planner, sent = HandPlanner(), list[OutRecord]()
    run = executor(planner, sent)
    bad = records(20, 1)[0]
    original = planner.go_on

    def with_a_letter(plan: Plan, found: Sequence[Any] | None = None) -> Plan:
        original(plan, found)
        plan.letters.append((bad, CodecError("not Avro")))
        return plan

    planner.go_on = with_a_letter   # type: ignore[method-assign]
    await run.fold([bad])
    assert [out.topic for out in sent] == ["out", "in.dlq"]


async def test_a_plan_that_wants_the_log_reads_it_once_and_goes_on_with_it() -> None:
    planner, sent = HandPlanner(want_first=True), list[OutRecord]()
    run = executor(planner, sent)
    reads: list[tuple[int, str, int, int]] = []

    async def read_back(partition: int, session_id: str, from_seq: int,
                        before: int) -> list[Any]:
        reads.append((partition, session_id, from_seq, before))
        # the plan's node writes so far are pending while the log is read (views see them)
        assert run.pending.node(0, "s/0", planner.tables) == {"message": "before the read"}
        return records(0, 2)

    run.read_back = read_back
    await run.fold(records(5, 2))
    assert reads == [(0, "s", 0, 5)]
    assert planner.calls == ["start", "go_on", "go_on"]
    assert [out.value for out in sent] == [b"5", b"6"]


async def test_a_failed_send_gives_the_partition_up_and_drops_the_planner_s_caches() -> None:
    planner, sent = HandPlanner(), list[OutRecord]()
    run = executor(planner, sent)
    await run.fold(records(0, 2), "kept-until-failure")
    assert planner.states == {"s": 2} and run.pending.folded_to == {0: 1}

    async def failing(out: OutRecord) -> None:
        raise BrokerError("the broker went away")

    run.send = failing
    with pytest.raises(BrokerError):
        await run.fold(records(2, 2), "fails")
    # the caches are data the executor drops: no call back into the planner
    assert planner.states == {} and planner.cursors == {} and run.pending.folded_to == {}
    assert (await run.persist()).folded == []   # the earlier batch was given up with it
    assert planner.tables.sessions == {}


async def test_a_rebalance_forgets_what_was_not_persisted() -> None:
    planner, sent = HandPlanner(), list[OutRecord]()
    run = executor(planner, sent)
    await run.fold(records(0, 4), "not-persisted")
    await run.forget()
    assert planner.states == {} and planner.cursors == {}
    assert (await run.persist()).folded == [] and planner.tables.sessions == {}


async def test_a_persist_and_a_fold_never_interleave_on_one_plan() -> None:
    """A persist takes the pending writes only between two batches: a plan waiting for
    its read of the log holds the lock."""
    planner, sent = HandPlanner(want_first=True), list[OutRecord]()
    run = executor(planner, sent)
    reading = asyncio.Event()
    release = asyncio.Event()

    async def slow_read(partition: int, session_id: str, from_seq: int,
                        before: int) -> list[Any]:
        reading.set()
        await release.wait()
        return []

    run.read_back = slow_read
    folding = asyncio.create_task(run.fold(records(0, 3), "slow"))
    await reading.wait()
    persisting = asyncio.create_task(run.persist())
    await asyncio.sleep(0.01)
    assert not persisting.done()          # waits for the batch to be performed whole
    release.set()
    await folding
    assert (await persisting).folded == ["slow"]
    assert planner.tables.sessions == {"s": {"next": 3}}
