"""``check``: an fsck for the session topic.

For every session (or the ones named): seq contiguous from 0 (a repeat is a duplicate, a skip
is a gap), every event valid (folded by core's :class:`~pipeline.core.log.SessionLog`, ingest
mode: the rules every writer must keep), no open turn older than a threshold, every tool call
of a finished turn answered by a ``tool/result``. Undecodable records count as problems of
the topic. The per-session work is pure (:func:`check_session`); only :func:`check_topic`
reads Kafka. Derived tables are compared by the CLI (it may use the processors' client).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.errors import EventError
from pipeline.core.events import Event
from pipeline.core.log import SessionLog
from pipeline.core.turn_config import config_disagreements
from pipeline.services.replay.topic import Decoder, LoggedEvent, read_sessions
from pipeline.settings import Settings


@dataclass(slots=True)
class SessionReport:
    """What :func:`check_session` found in one session (``log`` holds the valid prefix)."""

    session_id: str
    events: int = 0
    gaps: int = 0
    duplicates: int = 0
    invalid_events: int = 0
    open_turn_too_old: bool = False
    unanswered_calls: int = 0
    config_disagreements: int = 0  # request/header not stating the logged configuration
    problems: list[str] = field(default_factory=list)
    log: SessionLog | None = None

    @property
    def ok(self) -> bool:
        return not (self.gaps or self.duplicates or self.invalid_events
                    or self.open_turn_too_old or self.unanswered_calls
                    or self.config_disagreements)


def check_session(session_id: str, logged: Sequence[LoggedEvent], *, now_ms: int,
                  open_turn_max_age_ms: int) -> SessionReport:
    """Every rule of one session's records, in topic order."""
    report = SessionReport(session_id, events=len(logged))
    log = SessionLog(session_id, mode="ingest")
    report.log = log
    stopped = False
    for item in logged:
        event, where = item.event, f"partition {item.partition} offset {item.offset}"
        if event.seq < log.next_seq:
            report.duplicates += 1
            report.problems.append(f"{session_id}: duplicate seq {event.seq} at {where}")
            continue
        if stopped:
            continue
        if event.seq > log.next_seq:
            report.gaps += 1
            report.problems.append(f"{session_id}: gap: expected seq {log.next_seq}, found "
                                   f"{event.seq} at {where}; not checked past it")
            stopped = True
            continue
        try:
            log.append(event)
        except EventError as exc:
            report.invalid_events += 1
            report.problems.append(f"{session_id}: invalid event at {where}: {exc}")
            stopped = True
    # A fold stopped at a defect ends mid-turn: its "open turn" is that defect, not another.
    _check_turns(report, log.events, now_ms, None if stopped else open_turn_max_age_ms)
    return report


def _check_turns(report: SessionReport, events: Sequence[Event], now_ms: int,
                 max_age_ms: int | None) -> None:
    calls = _CallLedger()
    open_since: int | None = None
    for event in events:
        data = event.data if isinstance(event.data, dict) else {}
        if event.type == "turn/start":
            open_since = event.time
            calls = _CallLedger()
        elif event.type == "turn/end":
            open_since = None
            for call_id in calls.unanswered():
                report.unanswered_calls += 1
                report.problems.append(f"{report.session_id}: tool call {call_id!r} of turn "
                                       f"{data.get('turn')} has no tool/result")
        else:
            calls.see(event, data)
    for problem in config_disagreements(events):
        report.config_disagreements += 1
        report.problems.append(f"{report.session_id}: {problem}")
    if open_since is not None and max_age_ms is not None and now_ms - open_since > max_age_ms:
        report.open_turn_too_old = True
        age_s = (now_ms - open_since) // 1000
        report.problems.append(f"{report.session_id}: a turn has been open for {age_s}s "
                               f"(threshold {max_age_ms // 1000}s)")


class _CallLedger:
    """Tool calls of one turn (``tool/call`` events and tool-call blocks) and their answers."""

    def __init__(self) -> None:
        self.calls: dict[str, None] = {}
        self.answered: set[str] = set()
        self.anonymous_answers = 0

    def see(self, event: Event, data: dict[str, Any]) -> None:
        if event.type == "tool/call" and isinstance(data.get("callId"), str):
            self.calls.setdefault(data["callId"])
        elif event.type == "assistant/message":
            for block in _blocks(data.get("message")):
                if block.get("type") in ("tool-call", "tool_use") and isinstance(
                        block.get("id"), str):
                    self.calls.setdefault(block["id"])
        elif event.type == "tool/result":
            ids = _answered_ids(data)
            self.answered.update(ids)
            self.anonymous_answers += not ids  # the spec's simplified shape names no call

    def unanswered(self) -> list[str]:
        missing = [c for c in self.calls if c not in self.answered]
        return missing[self.anonymous_answers:]


def _blocks(message: Any) -> list[dict[str, Any]]:
    content = message.get("content") if isinstance(message, dict) else None
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _answered_ids(data: dict[str, Any]) -> set[str]:
    message = data.get("message")
    ids: set[str] = set()
    source = message.get("source") if isinstance(message, dict) else None
    if isinstance(source, dict) and isinstance(source.get("callId"), str):
        ids.add(source["callId"])
    for block in _blocks(message):
        for key in ("toolCallId", "tool_use_id"):
            if isinstance(block.get(key), str):
                ids.add(block[key])
    return ids


@dataclass(slots=True)
class CheckSummary:
    """The JSON summary ``check`` prints; ``ok`` when every count of a defect is 0."""

    reports: dict[str, SessionReport] = field(default_factory=dict)
    undecodable: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    derived_mismatches: int | None = None
    extra_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (all(r.ok for r in self.reports.values()) and not self.undecodable
                and not self.missing and not self.derived_mismatches)

    def to_json(self) -> dict[str, Any]:
        reports = list(self.reports.values())
        summary: dict[str, Any] = {
            "sessions": len(reports), "events": sum(r.events for r in reports),
            "invalid_sessions": sum(not r.ok for r in reports),
            "gaps": sum(r.gaps for r in reports),
            "duplicates": sum(r.duplicates for r in reports),
            "invalid_events": sum(r.invalid_events for r in reports),
            "open_turns_too_old": sum(r.open_turn_too_old for r in reports),
            "unanswered_calls": sum(r.unanswered_calls for r in reports),
            "config_disagreements": sum(r.config_disagreements for r in reports),
            "undecodable_records": len(self.undecodable),
            "missing_sessions": len(self.missing),
        }
        if self.derived_mismatches is not None:
            summary["derived_mismatches"] = self.derived_mismatches
        summary["ok"] = self.ok
        summary["problems"] = ([p for r in reports for p in r.problems] + self.undecodable
                               + [f"{s}: no events on the topic" for s in self.missing]
                               + self.extra_problems)
        return summary


async def check_topic(settings: Settings, decode: Decoder, *, now_ms: int,
                      open_turn_max_age_ms: int,
                      sessions: Collection[str] | None = None) -> CheckSummary:
    """Read the session topic (or the named sessions) and check every session."""
    found = await read_sessions(settings, decode, only=sessions)
    summary = CheckSummary(undecodable=found.undecodable)
    for session_id in sorted(found.events):
        summary.reports[session_id] = check_session(
            session_id, found.events[session_id], now_ms=now_ms,
            open_turn_max_age_ms=open_turn_max_age_ms)
    summary.missing = sorted(set(sessions or ()) - set(found.events))
    return summary
