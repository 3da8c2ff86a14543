"""Benchmark: two driver processes share a provider's limit under 10x overload, fairly by
tenant (issue 30).

Starts a local single-node Kafka (or uses ``--bootstrap``) and, in this process, the local
protocol server (``dev/dsh_dev/chaos/provider_server.py``) enforcing
``--rpm`` requests a minute the way providers do (``429`` + ``Retry-After``, the
``x-ratelimit-*`` headers on every answer). Two ``dsh-pipeline driver`` children share one
budget of the same size (``DSH_PROVIDER_LIMITS``; each holds its partitions' share), with
``--max-turns`` above the load so every turn is admitted and waits in the budget's queue.

The load: ``--sessions`` sessions in ten tenants, one with ten times the sessions of each
of the nine others (``send --tenant``), each session with ``--turns`` follow-ups, all sent
at once: ``sessions * turns`` calls, ten minutes of the limit at the defaults. The run lasts
``--seconds``; a budget holds a minute of its limit, so the first minute is a burst and the
figures are taken after it, over the steady window ``[60 s, end]`` (``--burst-s``):

* ``refused_pct``: the server's 429s over every call it got (the whole run);
* ``throughput_pct``: model calls answered in the window, per minute, over the limit;
* ``fair_share_min``: the lowest ratio of a 1x tenant's answered calls in the window to a
  fair share (the window's calls / 10), every tenant having calls waiting all along
  (``all_waiting``).

Answered calls are counted from the session topic (``assistant/message`` times, the drivers'
clocks on this machine). Prints one JSON line.

    .venv/bin/python bench/bench_provider_budget.py                 # the issue's run
    .venv/bin/python bench/bench_provider_budget.py --sessions 100 --rpm 60 --seconds 40 \
        --burst-s 10                                                 # the quick suite's
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from bench_driver_kafka import broker

from dsh_dev.chaos.provider_server import (
    LLMTestServer,
    RateLimits,
    ScriptedResponse,
    chat_chunk,
)
from dsh_dev.localstack.process import ChildProcess, free_ports
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.session_reader import read_session_partition
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.tenants import tenant_of_events
from pipeline.settings import Settings

PARTITIONS = 6
TENANTS = 10            # one at 10x, nine at 1x
BIG = "t-big"
READY_TIMEOUT_S = 120.0


def answer(_body: Any) -> ScriptedResponse:
    return ScriptedResponse(events=[chat_chunk(content="ok"), chat_chunk(
        finish_reason="stop", usage={"prompt_tokens": 20, "completion_tokens": 1})])


def tenant_sessions(sessions: int) -> dict[str, str]:
    """session id -> tenant: the big tenant has ten times the sessions of each other."""
    unit = max(1, round(sessions / (10 + TENANTS - 1)))
    names = [f"t-{n}" for n in range(1, TENANTS)]
    owners = [name for name in names for _ in range(unit)]
    owners += [BIG] * max(1, sessions - len(owners))
    return {f"s-{n:05d}": tenant for n, tenant in enumerate(owners)}


def start_drivers(settings: Settings, base_url: str, rpm: int, max_turns: int,
                  workdir: Path) -> list[tuple[ChildProcess, int]]:
    limits = json.dumps({"deepseek/*": {"requests_per_minute": rpm}})
    env = {**os.environ, **settings.to_env(), "DSH_PROVIDER": "deepseek",
           "DSH_MODEL": "deepseek-chat", "DSH_PROVIDER_BASE_URL": base_url,
           "DSH_DEEPSEEK_API_KEY": "sk-bench-budget", "DSH_PROVIDER_LIMITS": limits}
    drivers = []
    for n, port in enumerate(free_ports(2), start=1):
        argv = [sys.executable, "-m", "pipeline.cli.main", "driver", "--max-turns",
                str(max_turns), "--metrics-port", str(port)]
        drivers.append((ChildProcess(f"driver {n}", argv, workdir / f"driver-{n}.log",
                                     Path.cwd(), env=env), port))
    return drivers


async def wait_owning(drivers: list[tuple[ChildProcess, int]]) -> None:
    """Until the two drivers own every partition between them, each some."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            owned: list[list[int]] = []
            for process, port in drivers:
                if not process.alive():
                    raise RuntimeError(f"{process.name} exited: {process.log_tail()}")
                try:
                    body = (await client.get(f"http://127.0.0.1:{port}/health")).json()
                except (httpx.HTTPError, ValueError):
                    break
                owned.append(list(body.get("partitions", [])))
            flat = sorted(p for parts in owned for p in parts)
            if len(owned) == 2 and all(owned) and flat == list(range(PARTITIONS)):
                return
            await asyncio.sleep(0.3)
    raise RuntimeError("the drivers did not own every partition in time")


async def send_load(settings: Settings, tenants: dict[str, str], turns: int) -> None:
    codec = InboxCodec()
    records = [OutRecord(settings.topics.inbox, session.encode(), codec.encode(FollowUp(
        session, f"{session}-{turn}", ({"type": "text", "text": "hi"},), tenant=tenant)))
        for turn in range(turns) for session, tenant in tenants.items()]
    await send_records(settings, records)


async def session_logs(settings: Settings) -> dict[str, list[Event]]:
    logs: dict[str, list[Event]] = {}
    for partition in range(PARTITIONS):
        contents = await read_session_partition(settings, settings.topics.session_events,
                                                partition, EventSerde().decode)
        logs.update(contents.events)
    return logs


def _answered(event: Event) -> bool:
    """A model call the provider answered (a turn aborted at shutdown logs its message
    without usage)."""
    return event.type == "assistant/message" and isinstance(event.data, dict) \
        and event.data.get("usage") is not None


def figures(logs: dict[str, list[Event]], started_ms: int, window: tuple[float, float],
            rpm: int, sessions: int, turns: int) -> dict[str, Any]:
    """The run's figures from the session logs (see the module doc)."""
    low, high = (started_ms + int(s * 1000) for s in window)
    answered: Counter[str] = Counter()
    after: Counter[str] = Counter()   # sessions with calls still waiting at the window's end
    total = 0
    for events in logs.values():
        tenant = tenant_of_events(events)
        for event in events:
            if _answered(event):
                total += 1
                if low <= event.time < high:
                    answered[tenant] += 1
        if sum(1 for e in events if _answered(e) and e.time < high) < turns:
            after[tenant] += 1
    in_window = sum(answered.values())
    minutes = (window[1] - window[0]) / 60.0
    fair = in_window / TENANTS if in_window else 0.0
    small = [answered[f"t-{n}"] / fair if fair else 0.0 for n in range(1, TENANTS)]
    return {"sessions": sessions, "calls_asked": sessions * turns, "calls_answered": total,
            "window_s": [window[0], window[1]], "window_calls": in_window,
            "throughput_pct": round(100.0 * in_window / minutes / rpm, 1),
            "fair_share_min": round(min(small), 3), "fair_share_max": round(max(small), 3),
            "big_share": round(answered[BIG] / fair, 3) if fair else 0.0,
            "all_waiting": all(after[f"t-{n}"] for n in range(1, TENANTS)) and bool(after[BIG])}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with broker(args.bootstrap) as bootstrap, tempfile.TemporaryDirectory() as tmp:
        settings = Settings.from_env(
            {}, bootstrap_servers=bootstrap, topic_prefix=f"budget{uuid.uuid4().hex[:8]}.",
            partitions=PARTITIONS, replication_factor=1)
        await ensure_topics(settings)
        server = LLMTestServer(answer, keep_requests=False,
                               limits=RateLimits(requests_per_minute=args.rpm))
        await server.start()
        tenants = tenant_sessions(args.sessions)
        drivers = start_drivers(settings, server.base_url, args.rpm,
                                args.sessions * args.turns + 10, Path(tmp))
        try:
            await wait_owning(drivers)
            started_ms = int(time.time() * 1000)
            await send_load(settings, tenants, args.turns)
            await asyncio.sleep(args.seconds)
        finally:
            for process, _ in drivers:
                process.terminate()
            for process, _ in drivers:
                process.wait_stopped(30.0)
            await server.stop()
        assert server.limits is not None
        asked = server.limits.accepted + server.limits.rejected
        result = figures(await session_logs(settings), started_ms,
                         (args.burst_s, args.seconds), args.rpm, len(tenants), args.turns)
        result.update(rpm=args.rpm, server_calls=asked, refused=server.limits.rejected,
                      refused_pct=round(100.0 * server.limits.rejected / max(asked, 1), 2))
        return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", default="", help="use this Kafka (default: start one)")
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=3, help="follow-ups per session")
    parser.add_argument("--rpm", type=int, default=300, help="the server's and the budget's "
                                                             "requests per minute")
    parser.add_argument("--seconds", type=float, default=150.0, help="how long the run lasts")
    parser.add_argument("--burst-s", type=float, default=60.0, dest="burst_s",
                        help="the figures start after this (the budgets' first minute)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(asyncio.run(run(parse_args(argv)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
