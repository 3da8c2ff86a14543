"""Benchmark: a person's ``--approve`` sent -> the approved tool call started (issue 32).

Starts a local single-node Kafka (or uses ``--bootstrap``), creates fresh topics and runs
one in-process Kafka driver (linger 25 ms, as it ships) whose ``danger`` tool needs approval
(``--require-approval danger``). For each of ``--samples`` sessions, one after another: a
follow-up makes the scripted model call ``danger``; once the session waits (its runner says
so), an approve command is sent on the inbox exactly as ``send --approve`` encodes it (one
record, acks=all, idempotent; by a producer started beforehand, so a connection set-up is not
timed) and the clock runs from just before that send to the first line of the tool's
handler. The path timed: the inbox poll, the decision logged and committed (a flush: the call
runs at most once, so the decision is durable before it runs), the call dispatched.

Prints one JSON line: ``samples``, ``p50_ms``, ``p99_ms``, ``max_ms``, and the split
(wall clock, ms resolution): ``to_decision_*`` (sent -> the decision logged: the inbox poll
and the dispatch) and ``decision_to_start_*`` (-> the call started: mostly the commit).

    .venv/bin/python bench/bench_approval.py --samples 200
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

from aiokafka import AIOKafkaProducer
from bench_driver_kafka import broker

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.llm.scripted import ScriptedProvider, tool_loop_script
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.inbox import InboxCodec
from pipeline.core.approvals import ApprovalRules
from pipeline.core.inbox import Approve, FollowUp, InboxCommand
from pipeline.core.log import SessionLog
from pipeline.core.turn_effects import SessionConfig
from pipeline.core.turn_history import History
from pipeline.services.driver.kafka_sink import PartitionSink
from pipeline.services.driver.runner import SessionRunner
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.tools import ToolSpec, builtin_registry
from pipeline.settings import Settings


@dataclasses.dataclass
class Bench:
    settings: Settings
    service: DriverService
    producer: AIOKafkaProducer
    started: dict[str, float] = dataclasses.field(default_factory=dict)  # session -> perf
    # the split: sent -> decision logged (poll, dispatch) and -> call started (its commit)
    decided_ms: list[float] = dataclasses.field(default_factory=list)
    committed_ms: list[float] = dataclasses.field(default_factory=list)

    async def send(self, command: InboxCommand) -> None:
        await self.producer.send_and_wait(self.settings.topics.inbox,
                                          InboxCodec().encode(command),
                                          key=command.session_id.encode())

    def runner(self, session: str) -> SessionRunner | None:
        for owned in self.service.owned.values():
            slot = owned.sessions.get(session)
            if slot is not None and isinstance(slot.runner, SessionRunner):
                return slot.runner
        return None

    async def until(self, check: Any, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s} s")
            await asyncio.sleep(0.002)

    async def one(self, index: int) -> float:
        session = f"approve-{index}-{uuid.uuid4().hex[:6]}"
        await self.send(FollowUp(session, f"m-{index}", ({"type": "text", "text": "go"},)))

        def waiting() -> bool:
            runner = self.runner(session)
            return runner is not None and runner.machine.waiting_for is not None
        await self.until(waiting, "wait for approval")
        runner = self.runner(session)
        assert runner is not None and runner.machine.waiting_for is not None
        call_id = runner.machine.waiting_for
        sent, sent_wall = time.perf_counter(), time.time() * 1000
        await self.send(Approve(session, f"a-{index}", call_id))
        await self.until(lambda: session in self.started, "tool start")
        elapsed_ms = (self.started[session] - sent) * 1000
        decided = next(e.time for e in runner.log.events if e.type == "approval/decided")
        self.decided_ms.append(decided - sent_wall)
        self.committed_ms.append(elapsed_ms - (decided - sent_wall))
        await self.until(lambda: not runner.busy, "turn end")
        return elapsed_ms


def make_runner_factory(bench: list[Bench], settings: Settings) -> Any:
    async def danger(args: dict[str, Any]) -> str:
        started = time.perf_counter()
        session = str(args.get("session"))
        bench[0].started.setdefault(session, started)
        return "done"

    tools = builtin_registry()
    tools.register(ToolSpec("danger", "needs a person", {"type": "object"}, danger))
    config = SessionConfig(provider=settings.provider, model=settings.model)
    rules = ApprovalRules(require=("danger",))

    def make(log: SessionLog, sink: PartitionSink, history: History) -> SessionRunner:
        # the tool learns its session from its arguments: one script per session
        session_provider = ScriptedProvider(tool_loop_script(
            "danger", json.dumps({"session": log.session_id})))
        return SessionRunner(log, provider_factory=lambda _p, _m: session_provider,
                             tools=tools, sink=sink, config=config, approvals=rules,
                             admit=sink.admit_step, history=history)
    return make, tools


async def run(bootstrap: str, samples: int, partitions: int) -> dict[str, Any]:
    prefix = f"bench{uuid.uuid4().hex[:10]}."
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                                 partitions=partitions, replication_factor=1,
                                 group_id_prefix=f"{prefix}g-")
    await ensure_topics(settings)
    holder: list[Bench] = []
    make, tools = make_runner_factory(holder, settings)
    ctx = dataclasses.replace(driver_context(settings, group_id=f"{prefix}driver", tools=tools),
                              runner_factory=make)
    service = DriverService(ctx, DriverConfig(shutdown_grace_s=2))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    producer = AIOKafkaProducer(**client_options(settings), enable_idempotence=True,
                                acks="all")
    await producer.start()
    try:
        while not (service.ready.is_set() and len(service.owned) == partitions):
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        holder.append(Bench(settings, service, producer))
        for index in range(5):  # warm-up: the first transactions of a fresh broker
            await holder[0].one(-1 - index)
        timings = [await holder[0].one(index) for index in range(samples)]
    finally:
        await producer.stop()
        stop.set()
        await asyncio.wait_for(task, 60)
    bench = holder[0]
    del bench.decided_ms[:5], bench.committed_ms[:5]  # the warm-up's
    return {"samples": samples, "p50_ms": _q(timings, 0.5), "p99_ms": _q(timings, 0.99),
            "max_ms": _q(timings, 1.0), "to_decision_p50_ms": _q(bench.decided_ms, 0.5),
            "to_decision_p99_ms": _q(bench.decided_ms, 0.99),
            "decision_to_start_p50_ms": _q(bench.committed_ms, 0.5),
            "decision_to_start_p99_ms": _q(bench.committed_ms, 0.99)}


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--bootstrap", help="use this broker instead of starting one")
    args = parser.parse_args()
    with broker(args.bootstrap) as bootstrap:
        result = asyncio.run(run(bootstrap, args.samples, args.partitions))
    print(json.dumps({**result, "partitions": args.partitions}))


if __name__ == "__main__":
    main()
