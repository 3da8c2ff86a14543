"""The campaign's invariants: each gives a result line and, when violated, what and where.

All read the cluster directly (not through the proxies) after the faults have stopped and the
fleet has gone quiet; :func:`check_logs` also runs periodically during the campaign (then an
open turn is not a violation: turns are running).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

from dsh_dev.chaos.bounded import run_bounded
from dsh_dev.chaos.faults import FaultRecord, GarbageRecord
from dsh_dev.chaos.load import SentCommand
from pipeline.adapters.kafka.dlq import (
    ERROR_CLASS,
    ERROR_MESSAGE,
    ORIGINAL_OFFSET,
    ORIGINAL_PARTITION,
    ORIGINAL_TOPIC,
)
from pipeline.adapters.kafka.records import header_value
from pipeline.adapters.kafka.topic_scan import TopicScan
from pipeline.adapters.metrics.consumer_lag import ConsumerLagProbe, LagSample
from pipeline.core.errors import DshError, EventError
from pipeline.core.events import Event, dumps_json
from pipeline.core.inbox import SPLICE_TYPE
from pipeline.core.log import SessionLog, derive_messages
from pipeline.core.turn_config import CONFIG_TYPE
from pipeline.services.processors.verify import verify_processors
from pipeline.services.replay.check import check_session
from pipeline.services.replay.topic import TopicSessions
from pipeline.settings import Settings

MAX_LISTED: Final = 20
LAG_BUDGET_S: Final = 180.0
PROBE_TIMEOUT_S: Final = 15.0


@dataclass(slots=True)
class Result:
    name: str
    ok: bool
    summary: str
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # seen, reported, not a violation

    def add(self, violation: str) -> None:
        self.ok = False
        if len(self.violations) < MAX_LISTED:
            self.violations.append(violation)


def events_of(found: TopicSessions, session_id: str) -> list[Event]:
    return [logged.event for logged in found.events.get(session_id, [])]


def check_logs(found: TopicSessions, sessions: Sequence[str], *, final: bool) -> Result:
    """Strict-valid, no gap or duplicate, and (``final``) no open turn and no session
    without events (during the faults a session's first commands may still be queued)."""
    result = Result("session logs strict-valid, no gap, duplicate or open turn", True, "")
    now_ms = int(time.time() * 1000)
    events = 0
    for session_id in sessions:
        logged = found.events.get(session_id, [])
        events += len(logged)
        if not logged:
            if final:
                result.add(f"session {session_id}: no events on the topic")
            continue
        report = check_session(session_id, logged, now_ms=now_ms,
                               open_turn_max_age_ms=0 if final else 3_600_000)
        for problem in report.problems:
            result.add(problem)
        strict = SessionLog(session_id, mode="strict")
        for item in logged:
            try:
                strict.append(item.event)
            except EventError as exc:
                result.add(f"session {session_id}: seq {item.event.seq} at partition "
                           f"{item.partition} offset {item.offset} not strict-valid: {exc}")
                break
    result.summary = f"{len(sessions)} sessions, {events} events"
    return result


def check_zombies(faults: Sequence[FaultRecord], logs: Result) -> Result:
    """A driver resumed after its session timeout appended nothing: its appends would repeat
    seqs the new owner wrote (a duplicate, or an invalid event, in the logs' check)."""
    stops = [f for f in faults if f.kind == "stop-driver"]
    fenced = sum(int(f.detail.get("fenced_lines", 0)) for f in stops)
    duplicates = [v for v in logs.violations if "duplicate" in v or "invalid" in v]
    result = Result("a driver stopped past its session timeout appended nothing after it "
                    "resumed", True, f"{len(stops)} SIGSTOP/SIGCONT; {fenced} log lines of the "
                    "resumed drivers about fencing or revoked partitions; no duplicate seq")
    for violation in duplicates:
        result.add(violation)
    return result


def check_commands(found: TopicSessions, sent: Sequence[SentCommand]) -> Result:
    """Every acknowledged follow-up/steer/inject/configure entered its session exactly once."""
    entered: Counter[tuple[str, str]] = Counter()
    for session_id, logged in found.events.items():
        for item in logged:
            for message_id in _command_ids(item.event):
                entered[(session_id, message_id)] += 1
    result = Result("every inbox command entered its session exactly once", True, "")
    checked = 0
    for command in sent:
        if command.kind == "cancel":
            continue  # a cancel leaves no id in the log (see docs/chaos.md)
        checked += 1
        count = entered[(command.session_id, command.message_id)]
        if count != 1:
            result.add(f"session {command.session_id}: {command.kind} {command.message_id} "
                       f"(inbox partition {command.partition} offset {command.offset}) "
                       f"entered {count} times")
    cancels = sum(c.kind == "cancel" for c in sent)
    result.summary = (f"{checked} commands checked by id ({cancels} cancels not identifiable "
                      f"in the log)")
    return result


def _command_ids(event: Event) -> list[str]:
    data = event.data if isinstance(event.data, dict) else {}
    if event.type == CONFIG_TYPE and isinstance(data.get("messageId"), str):
        return [str(data["messageId"])]
    if event.type == SPLICE_TYPE and isinstance(data.get("inserted"), list):
        return [str(m["id"]) for m in data["inserted"] if isinstance(m, dict) and "id" in m]
    return []


def check_repairs(found: TopicSessions, sessions: Sequence[str]) -> Result:
    """Every turn left open by a crash was closed by crash repair (``interrupted``)."""
    result = Result("every interrupted turn was repaired", True, "")
    repaired = 0
    for session_id in sessions:
        open_turn: int | None = None
        for event in events_of(found, session_id):
            data = event.data if isinstance(event.data, dict) else {}
            if event.type == "turn/start":
                if open_turn is not None:
                    result.add(f"session {session_id}: turn {open_turn} still open at seq "
                               f"{event.seq} (turn/start of the next)")
                open_turn = data.get("turn")
            elif event.type == "turn/end":
                reason = data.get("reason")
                repaired += isinstance(reason, dict) and reason.get("kind") == "interrupted"
                open_turn = None
        if open_turn is not None:
            result.add(f"session {session_id}: turn {open_turn} open at the end")
    result.summary = f"{repaired} turns closed by crash repair (turn/end interrupted)"
    return result


def check_shipped(found: TopicSessions, files: Mapping[str, Sequence[Event]]) -> Result:
    """Every event of every shipped file is on the topic exactly once, identical."""
    result = Result("every file the shipper saw is on the topic exactly once", True, "")
    for session_id, expected in files.items():
        logged = found.events.get(session_id, [])
        on_topic = [item.event for item in logged]
        seqs = Counter(e.seq for e in on_topic)
        duplicated = sorted(s for s, n in seqs.items() if n > 1)
        if duplicated:
            where = [f"offset {i.offset} ({_what(i.event)})" for i in logged
                     if i.event.seq == duplicated[0]]
            result.add(f"session {session_id}: seq {duplicated[0]} on the topic "
                       f"{seqs[duplicated[0]]} times: {', '.join(where)}; {len(duplicated)} "
                       f"seqs twice in all")
        elif on_topic != list(expected):
            first = next((n for n, (a, b) in enumerate(zip(on_topic, expected, strict=False))
                          if a != b), min(len(on_topic), len(expected)))
            extra = [f"offset {i.offset} {_what(i.event)}" for i in logged[first:first + 3]]
            result.add(f"session {session_id}: topic has {len(on_topic)} events, the file "
                       f"{len(expected)}; first difference at seq {first}: topic "
                       f"{', '.join(extra) or 'ends'}")
    result.summary = (f"{len(files)} files, "
                      f"{sum(len(e) for e in files.values())} events")
    return result


def _what(event: Event) -> str:
    """An event's type, and the kind of a turn/end's reason, for violation messages."""
    data = event.data if isinstance(event.data, dict) else {}
    reason = data.get("reason")
    kind = f" {reason.get('kind')}" if isinstance(reason, dict) else ""
    return f"{event.type}{kind}"


async def check_processors(urls: Sequence[str], logs: Mapping[str, Sequence[Event]],
                           timeout_s: float, evidence: Path) -> Result:
    """Each worker's tables and usage equal core's fold of the logs (a fresh replay).

    A session whose derived messages differ is described (where the two lists part) and
    both lists are saved under ``evidence``.
    """
    result = Result("processors' tables and usage equal a fresh replay", True, "")
    for url in urls:
        try:
            report = await verify_processors(url, logs, timeout_s=timeout_s)
        except DshError as exc:
            result.add(f"{url}: {exc}")
            continue
        for problem in report.problems:
            session_id = problem.split(":", 1)[0]
            detail = ""
            if "derived messages differ" in problem and session_id in logs:
                detail = await _describe_derived(url, session_id, logs[session_id], evidence)
            result.add(f"{url}: {problem}{detail}")
        if not report.ok and not report.problems:
            result.add(f"{url}: {report.summary()}")
    result.summary = f"{len(logs)} sessions compared on {len(urls)} workers"
    return result


async def _describe_derived(url: str, session_id: str, events: Sequence[Event],
                            evidence: Path) -> str:
    expected = [json.loads(dumps_json(m)) for m in derive_messages(events)]
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as http, http.get(
                f"{url}/sessions/{session_id}/messages") as answer:
            body = await answer.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return f" (could not read them again: {exc})"
    found = body.get("messages", [])
    first = next((n for n, (a, b) in enumerate(zip(found, expected, strict=False)) if a != b),
                 min(len(found), len(expected)))
    evidence.mkdir(parents=True, exist_ok=True)
    path = evidence / f"derived-{session_id}.json"
    path.write_text(json.dumps({"worker": found, "core": expected,
                                "worker_seqs": body.get("seqs"),
                                "nextSeq": body.get("nextSeq")}, indent=1), encoding="utf-8")

    def brief(items: list[Any]) -> str:
        if first >= len(items):
            return "nothing"
        item = items[first]
        text = json.dumps(item.get("content"))[:80] if isinstance(item, dict) else str(item)
        return f"{item.get('role') if isinstance(item, dict) else '?'} {text}"
    return (f": worker has {len(found)} messages, core {len(expected)}; first difference at "
            f"message {first}: worker {brief(found)} / core {brief(expected)} (both in {path})")


async def check_dead_letters(settings: Settings, garbage: Sequence[GarbageRecord]) -> Result:
    """The dead-letter topics hold exactly the injected garbage, each once with a reason."""
    result = Result("dead-letter topics hold exactly the injected garbage, once, with reasons",
                    True, "")
    letters: Counter[tuple[str, int, int]] = Counter()
    reasons: dict[tuple[str, int, int], str] = {}
    topics = (settings.topics.inbox, settings.topics.session_events)
    for topic in topics:
        async with TopicScan(settings, settings.topics.dlq(topic)) as scan:
            async for batch in scan.batches():
                for record in batch:
                    where = _dlq_origin(record.headers)
                    letters[where] += 1
                    error = header_value(record.headers, ERROR_CLASS) or b""
                    message = header_value(record.headers, ERROR_MESSAGE) or b""
                    reasons[where] = f"{error.decode()}: {message.decode()[:80]}"
    injected = {(g.topic, g.partition, g.offset) for g in garbage}
    repeated = 0
    for where, count in letters.items():
        name = f"{where[0]}[{where[1]}] offset {where[2]}"
        if where not in injected:
            result.add(f"dead letter of {name} was not injected ({reasons.get(where)})")
        elif count > 1:
            repeated += 1
            result.add(f"{name} dead-lettered {count} times")
        elif not reasons.get(where, "").strip(": "):
            result.add(f"dead letter of {name} has no reason")
    for where in sorted(injected - letters.keys()):
        result.add(f"garbage at {where[0]}[{where[1]}] offset {where[2]} has no dead letter")
    result.summary = (f"{len(garbage)} injected, {len(letters)} records dead-lettered, "
                      f"{sum(letters.values())} dead letters ({repeated} records "
                      f"dead-lettered more than once)")
    return result


def _dlq_origin(headers: Any) -> tuple[str, int, int]:
    topic = (header_value(headers, ORIGINAL_TOPIC) or b"").decode()
    partition = int((header_value(headers, ORIGINAL_PARTITION) or b"-1").decode())
    offset = int((header_value(headers, ORIGINAL_OFFSET) or b"-1").decode())
    return topic, partition, offset


async def wait_lag_zero(settings: Settings, budget_s: float = LAG_BUDGET_S,
                        groups: Collection[str] = ()) -> tuple[Result, float | None]:
    """Every consumer group on the inbox and session topic at lag 0 within ``budget_s``.

    A sample counts only when it holds every group of ``groups`` and of the samples before
    it: a group whose offsets could not be read (the coordinator answered with a
    group-level error, which the admin client drops) is missing, not at lag 0.
    """
    name = (f"every consumer group's lag returns to 0 within {budget_s:.0f} s after the "
            "faults stop")
    began = time.monotonic()
    last: list[str] = ["no sample"]
    expected = set(groups)
    while time.monotonic() - began < budget_s:
        samples, last = await lag_once(settings)
        present = {s.group for s in samples}
        last += [f"group {g}: its offsets were not read" for g in sorted(expected - present)]
        expected |= present
        if samples and not last:
            took = time.monotonic() - began
            return Result(name, True, f"{len(present)} groups at lag 0 after {took:.1f} s"), took
        await asyncio.sleep(1.0)
    result = Result(name, True, "still lagging")
    for line in last:
        result.add(line)
    return result, None


async def lag_once(settings: Settings) -> tuple[list[LagSample], list[str]]:
    """One sample with a probe of its own, bounded in time: (samples, what lags)."""
    try:
        samples = await run_bounded(lambda: _sample(settings), PROBE_TIMEOUT_S)
    except (DshError, TimeoutError) as exc:
        return [], [f"lag probe: {type(exc).__name__}: {exc}"]
    lagging = [f"group {s.group} {s.topic}[{s.partition}] committed {s.committed} end "
               f"{s.end}" for s in samples if s.records]
    return samples, lagging if samples else ["no committed offsets yet"]


async def _sample(settings: Settings) -> list[LagSample]:
    probe = ConsumerLagProbe(settings, (settings.topics.inbox, settings.topics.session_events))
    try:
        await probe.start()
        return await probe.sample(int(time.time() * 1000))
    finally:
        await probe.stop()


async def check_dashboard(url: str, found: TopicSessions, sessions: Sequence[str],
                          timeout_s: float) -> Result:
    """The dashboard's row of every session shows its last seq and final state."""
    result = Result("the dashboard shows every session's final state", True, "")
    deadline = time.monotonic() + timeout_s
    wrong: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while True:
            try:
                async with http.get(f"{url}/api/fleet") as answer:
                    rows = {r["session_id"]: r for r in (await answer.json())["sessions"]}
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
                rows, wrong = {}, [f"{url}/api/fleet: {exc}"]
            else:
                wrong = [w for s in sessions for w in _row_problems(s, rows.get(s), found)]
            if not wrong or time.monotonic() > deadline:
                break
            await asyncio.sleep(2.0)
    for problem in wrong:
        result.add(problem)
    result.summary = f"{len(sessions)} sessions compared"
    return result


def _row_problems(session_id: str, row: Mapping[str, Any] | None,
                  found: TopicSessions) -> list[str]:
    events = events_of(found, session_id)
    if row is None:
        return [f"session {session_id}: not on the dashboard"]
    last = events[-1].seq if events else None
    ends = [e for e in events if e.type == "turn/end"]
    reason = ends[-1].data.get("reason", {}).get("kind") if ends and isinstance(
        ends[-1].data, dict) else None
    problems = []
    if row.get("last_seq") != last:
        problems.append(f"session {session_id}: dashboard last_seq {row.get('last_seq')}, "
                        f"log {last}")
    if row.get("state") != "idle":
        problems.append(f"session {session_id}: dashboard state {row.get('state')!r}")
    if row.get("last_end_reason") != reason:
        problems.append(f"session {session_id}: dashboard last_end_reason "
                        f"{row.get('last_end_reason')!r}, log {reason!r}")
    return problems
