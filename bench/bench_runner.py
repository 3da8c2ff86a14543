"""Benchmark: the turn machine + session runner, in memory, with the scripted provider.

Measures what the driver itself costs, without Kafka:

* overhead per step: wall time from the publication of ``step/start`` to that of ``step/end``
  of one session running alone (the scripted provider answers at once, the tool is ``echo``),
  p50 and p99 over ``--solo-steps`` steps, measured after the fleet run below while its events
  are still held (as ``bench/suite_services.py`` does), so a collection over a big heap shows;
* throughput: steps/s with ``--sessions`` sessions running concurrently in one process, each
  doing ``--turns`` two-step tool turns (tool call, then the answer).

``cpu_seconds`` / ``steps_per_cpu_s`` are process CPU time: on a shared machine they say
what the driver costs when wall time is inflated by other processes.

Both runs use the driver's collector policy (``pipeline/services/driver/gc_tuning.py``, what
``dsh-pipeline driver`` runs under); ``--default-gc`` measures with CPython's defaults.

Every log is re-validated in strict mode at the end (``invalid_logs`` must be 0).

    .venv/bin/python bench/bench_runner.py --sessions 1000
    .venv/bin/python bench/bench_runner.py --sessions 1000 --chunk-delay-ms 5   # paced streams
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence

from pipeline.adapters.llm.scripted import ScriptedProvider, ScriptedReply, tool_loop_script
from pipeline.core.errors import DshError
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.log import SessionLog
from pipeline.core.model import ModelRequest
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.gc_tuning import driver_gc
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.tools import builtin_registry


class TimingSink(MemorySink):
    """Records the wall time of each step (step/start publication -> step/end publication)."""

    def __init__(self) -> None:
        super().__init__()
        self.step_ms: list[float] = []
        self._open: dict[str, float] = {}
        self.cpu_seconds = 0.0

    async def emit(self, session_id: str, events: Sequence[Event]) -> None:
        await super().emit(session_id, events)
        now = time.perf_counter()
        for event in events:
            if event.type == "step/start":
                self._open[session_id] = now
            elif event.type == "step/end" and session_id in self._open:
                self.step_ms.append((now - self._open.pop(session_id)) * 1000)


def new_driver(sink: TimingSink, chunk_delay_ms: int = 0) -> Driver:
    loop = tool_loop_script("echo", '{"text": "pong"}')

    def script(request: ModelRequest, attempt: int) -> ScriptedReply:
        return dataclasses.replace(loop(request, attempt), chunk_delay_ms=chunk_delay_ms)

    provider = ScriptedProvider(script)
    return Driver(provider_factory=lambda _p, _m: provider, tools=builtin_registry(),
                  sink=sink, config=SessionConfig("scripted", "bench"))


def follow_up(session_id: str, turn: int) -> FollowUp:
    return FollowUp(session_id, f"m{turn}", ({"type": "text", "text": f"ping {turn}"},))


async def run_fleet(sessions: int, turns: int, chunk_delay_ms: int = 0, *,
                    default_gc: bool = False) -> tuple[TimingSink, float]:
    """``sessions`` sessions at once; each round gives every session one more turn."""
    with _gc_policy(default_gc):
        return await _run_fleet(sessions, turns, chunk_delay_ms)


def _gc_policy(default_gc: bool) -> contextlib.AbstractContextManager[object]:
    """The collector policy a driver process runs under (``gc_tuning``), unless asked for
    CPython's defaults. Entering it freezes what the process holds already, e.g. the events
    of an earlier fleet run that the caller keeps."""
    return contextlib.nullcontext() if default_gc else driver_gc()


async def _run_fleet(sessions: int, turns: int, chunk_delay_ms: int) -> tuple[TimingSink, float]:
    sink = TimingSink()
    driver = new_driver(sink, chunk_delay_ms)
    started, cpu_started = time.perf_counter(), time.process_time()
    for turn in range(turns):
        for n in range(sessions):
            driver.submit(follow_up(f"s{n}", turn))
        await driver.drain()
    sink.cpu_seconds = time.process_time() - cpu_started
    return sink, time.perf_counter() - started


async def run_solo(turns: int, *, default_gc: bool = False) -> TimingSink:
    """One session at a time (a fresh one every 5 turns: typical lengths, no contention)."""
    sink = TimingSink()
    driver = new_driver(sink)
    with _gc_policy(default_gc):
        for turn in range(turns):
            driver.submit(follow_up(f"solo{turn // 5}", turn))
            await driver.drain()
    return sink


def invalid_logs(sink: MemorySink) -> int:
    bad = 0
    for session_id, events in sink.events.items():
        try:
            SessionLog.from_events(session_id, events, mode="strict")
        except DshError:
            bad += 1
    return bad


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def main(args: argparse.Namespace) -> dict[str, object]:
    fleet, elapsed = await run_fleet(args.sessions, args.turns, args.chunk_delay_ms,
                                     default_gc=args.default_gc)
    solo = await run_solo(args.solo_steps // 2, default_gc=args.default_gc)
    steps = len(fleet.step_ms)
    events = sum(len(e) for e in fleet.events.values())
    return {
        "sessions": args.sessions, "chunk_delay_ms": args.chunk_delay_ms,
        "turns": args.sessions * args.turns, "steps": steps,
        "events": events, "seconds": round(elapsed, 3),
        "steps_per_s": round(steps / elapsed, 1), "events_per_s": round(events / elapsed),
        "cpu_seconds": round(fleet.cpu_seconds, 3),
        "steps_per_cpu_s": round(steps / fleet.cpu_seconds, 1),
        "solo_step_overhead_ms_p50": round(percentile(solo.step_ms, 50), 3),
        "solo_step_overhead_ms_p99": round(percentile(solo.step_ms, 99), 3),
        "invalid_logs": invalid_logs(fleet) + invalid_logs(solo),
        "default_gc": args.default_gc,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--solo-steps", type=int, default=2000)
    parser.add_argument("--default-gc", action="store_true",
                        help="CPython's collector settings instead of the driver's gc_tuning")
    parser.add_argument("--chunk-delay-ms", type=int, default=0,
                        help="scripted streaming pace in the fleet run (0: as fast as possible)")
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
