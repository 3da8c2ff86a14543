"""Append+fold cost per event against session length (issue 3, performance).

Usage: .venv/bin/python bench/bench_core_fold.py [--events 100000] [--rounds 3] [--mode strict]

Goal: the cost of ``SessionLog.append`` (validation + surface fold + turn bookkeeping) per event
is flat in session length: a 100,000-event session within 1.5x of a 10-event session.

Method. One synthetic session (:mod:`dsh_dev.synth`, the fixtures' event mix) of
``--events`` events. For a session length L, the figure is the CPU time per event of appending
events to a log that already holds up to L events: windows of the stream re-based to seq 0
(sources outside the window dropped, replaces turned into appends), each
folded into a fresh log, for L <= 10,000 (log construction included); and the last 10,000
appends of the whole stream for the full length. Best of ``--rounds``, in CPU time of this
process (the machine is shared: wall time would measure the neighbours).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

from dsh_dev.synth import synth_session
from pipeline.core.events import APPEND, Event, Replace
from pipeline.core.log import Mode, SessionLog


def rebase(window: list[Event]) -> list[Event]:
    """``window`` as a session of its own: seqs from 0, sources kept only inside it, and
    replaces (compaction summaries, a fraction of a percent of events) folded as appends, since
    the nodes they shadow may lie before the window."""
    first = window[0].seq
    out: list[Event] = []
    for event in window:
        op = APPEND if isinstance(event.surface_op, Replace) else event.surface_op
        sources = event.source_event_seqs
        if sources is not None:
            inside = tuple(s - first for s in sources if s >= first)
            sources = inside if inside or event.type == "assistant/message" else None
        out.append(dataclasses.replace(event, seq=event.seq - first, surface_op=op,
                                       source_event_seqs=sources))
    return out


def windows_cost(events: list[Event], length: int, mode: Mode, budget: int) -> float:
    """CPU seconds per event folding re-based windows of ``length`` into fresh logs."""
    rng = random.Random(length)
    sessions: list[list[Event]] = []
    for _ in range(max(1, budget // length)):
        start = rng.randrange(len(events) - length)
        sessions.append(rebase(events[start:start + length]))
    started = time.process_time()
    for session in sessions:
        log = SessionLog("s", mode=mode)
        for event in session:
            log.append(event)
    return (time.process_time() - started) / sum(len(s) for s in sessions)


def tail_cost(events: list[Event], mode: Mode, tail: int) -> float:
    """CPU seconds per event for the last ``tail`` appends of the whole session."""
    log = SessionLog("s", mode=mode)
    log.extend(events[:-tail])
    started = time.process_time()
    for event in events[-tail:]:
        log.append(event)
    return (time.process_time() - started) / tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000, help="session length")
    parser.add_argument("--rounds", type=int, default=3, help="best of this many rounds")
    parser.add_argument("--mode", choices=["strict", "ingest"], default="strict",
                        help="validation mode of the log")
    args = parser.parse_args()
    events = synth_session(1, args.events)
    mode: Mode = args.mode
    rows = []
    for length in (10, 100, 1_000, 10_000):
        cost = min(windows_cost(events, length, mode, 20_000) for _ in range(args.rounds))
        rows.append((length, cost))
    full = min(tail_cost(events, mode, 10_000) for _ in range(args.rounds))
    rows.append((args.events, full))
    print(f"append+fold ({mode}), CPU time per event, {args.events:,}-event synthetic session")
    for length, cost in rows:
        print(f"  session length {length:>7,}: {cost * 1e6:6.2f} us/event")
    ratio = full / rows[0][1]
    print(f"  {args.events:,} vs 10 events: {ratio:.2f}x (goal <= 1.5x)")


if __name__ == "__main__":
    main()
