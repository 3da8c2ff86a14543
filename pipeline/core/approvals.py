"""Durable human approval of tool calls: the rules, the log events and their fold (sans-I/O).

A tool call whose name matches an approval rule (a glob: the driver's ``--require-approval``
patterns plus the session's own, from ``send --configure --require-approval``) needs a person.
It is recorded as requested (``tool/call``), then as waiting with dsh's own audit event, and
the turn waits; a decision from the inbox (``send --approve`` / ``--deny``), a cancel or the
expiry of ``--approval-timeout`` closes it. The events follow dsh's user-approval package:

- ``approval/asked {id, toolName, callId, reason}``: one fresh ``id`` per question;
- ``approval/decided {id, outcome}``: exactly one per ask, ``outcome`` one of
  ``allowed-once`` (approved), ``rejected`` (denied, or the session's policy is ``never``),
  ``cancelled`` (the turn was canceled while it waited), ``unavailable`` (nobody answered
  before the timeout: fail closed, as dsh does when no answerer is there);
- ``approval/policy {policy}``: the session's switch to ``ask`` (wait for a person) or
  ``never`` (reject every gated call at once, without asking); the last one wins.

dsh's events carry no who, when or why. Each decision is preceded by one ignorable
:data:`DECISION_TYPE` event that does: ``{id, callId, outcome, decision, messageId?, by?,
reason?}`` (``decision``: approve, deny, timeout, cancel or policy; ``by``: the inbox
command's ``source``; the event's time is when). A decision that comes too late (the call
was decided already, or never waited) is logged as an ignorable :data:`REFUSED_TYPE` event
``{messageId, callId, decision, refusal}`` naming who won: a racing second decision is
refused with that message and changes nothing. Both carry the command's ``messageId``, so a
re-delivered decision is recognised from the log alone.

Everything a driver needs after a crash or takeover is in these events: :class:`ApprovalBook`
folds them (:func:`waiting_approval` says whether the open turn waits: crash repair must not
close it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Final, TypeGuard

from pipeline.core.errors import CodecError
from pipeline.core.events import Event, JsonValue

ASKED: Final = "approval/asked"
DECIDED: Final = "approval/decided"
POLICY: Final = "approval/policy"
DECISION_TYPE: Final = "dsh-pipeline/approval"
REFUSED_TYPE: Final = "dsh-pipeline/approval-refused"
ALLOWED: Final = "allowed-once"
REJECTED: Final = "rejected"
CANCELLED: Final = "cancelled"
UNAVAILABLE: Final = "unavailable"
OUTCOMES: Final = (ALLOWED, REJECTED, CANCELLED, UNAVAILABLE)
POLICIES: Final = ("ask", "never")
APPROVAL_ERROR: Final = "ToolApprovalError"


@dataclass(frozen=True, slots=True)
class ApprovalRules:
    """The driver's approval settings: glob patterns over tool names, the wait's bound
    (None: wait for ever) and the policy of a session that never switched one."""

    require: tuple[str, ...] = ()
    timeout_ms: int | None = None
    policy: str = "ask"


def matching_rule(patterns: Iterable[str], tool_name: str) -> str | None:
    """The first pattern that matches ``tool_name`` (case-sensitive glob), or None."""
    for pattern in patterns:
        if fnmatchcase(tool_name, pattern):
            return pattern
    return None


@dataclass(frozen=True, slots=True)
class Waiting:
    """The question the open turn waits on: its ``approval/asked`` and when it was asked."""

    id: str
    call_id: str
    tool_name: str
    asked_at: int


@dataclass(slots=True)
class ApprovalBook:
    """What the log says about approvals: folded event by event (:meth:`advance`)."""

    policy: str | None = None            # the last approval/policy (None: the driver's)
    require: tuple[str, ...] = ()        # the session's own patterns (its last configure)
    waiting: Waiting | None = None       # an ask with no decision yet
    verdicts: dict[str, str] = field(default_factory=dict)  # call id -> who decided, how
    message_ids: set[str] = field(default_factory=set)      # decisions taken or refused

    def advance(self, event: Event) -> None:
        data = event.data
        if not isinstance(data, Mapping):
            return
        if event.type == ASKED and isinstance(data.get("id"), str):
            self.waiting = Waiting(str(data["id"]), str(data.get("callId", "")),
                                   str(data.get("toolName", "")), event.time)
        elif event.type == DECIDED and self.waiting is not None \
                and data.get("id") == self.waiting.id:
            self.waiting = None
        elif event.type == "turn/end":
            self.waiting = None  # an ask left open by an older writer's repair
        elif event.type == POLICY and data.get("policy") in POLICIES:
            self.policy = str(data["policy"])
        elif event.type in (DECISION_TYPE, REFUSED_TYPE):
            self._note_decision(event.type, data)
        elif event.type == "dsh-pipeline/config" and isinstance(data.get("requireApproval"),
                                                                list):
            self.require = tuple(str(p) for p in data["requireApproval"])

    def _note_decision(self, type_: str, data: Mapping[str, JsonValue]) -> None:
        message_id = data.get("messageId")
        if isinstance(message_id, str):
            self.message_ids.add(message_id)
        if type_ == DECISION_TYPE and isinstance(data.get("callId"), str):
            self.verdicts[str(data["callId"])] = verdict_text(data)

    def to_json(self) -> dict[str, JsonValue]:
        """Every field; ``messageIds`` sorted, so equal books give equal JSON."""
        waiting = self.waiting
        return {"policy": self.policy, "require": list(self.require),
                "waiting": None if waiting is None else {
                    "id": waiting.id, "callId": waiting.call_id, "toolName": waiting.tool_name,
                    "askedAt": waiting.asked_at},
                "verdicts": dict(self.verdicts), "messageIds": sorted(self.message_ids)}

    @classmethod
    def from_json(cls, raw: JsonValue) -> ApprovalBook:
        """The book :meth:`to_json` gave (fresh containers); :class:`CodecError` if a field
        does not fit."""
        if not isinstance(raw, Mapping):
            raise CodecError("an approval book must be a JSON object")
        policy, require, verdicts = raw.get("policy"), raw.get("require"), raw.get("verdicts")
        ids = raw.get("messageIds")
        if not (policy is None or isinstance(policy, str)) or not _strings(require) \
                or not _strings(ids) or not isinstance(verdicts, Mapping) \
                or not all(isinstance(v, str) for v in verdicts.values()):
            raise CodecError("an approval book needs policy (string or null), require and "
                             "messageIds (lists of strings) and verdicts (strings by call id)")
        return cls(policy=policy, require=tuple(require), waiting=_waiting(raw.get("waiting")),
                   verdicts={str(k): str(v) for k, v in verdicts.items()},
                   message_ids=set(ids))

    def effective_policy(self, rules: ApprovalRules) -> str:
        return self.policy if self.policy is not None else rules.policy

    def rule_for(self, rules: ApprovalRules, tool_name: str) -> str | None:
        """The pattern that gates ``tool_name`` (the driver's first, then the session's)."""
        return matching_rule(rules.require + self.require, tool_name)


def _strings(value: JsonValue) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _waiting(raw: JsonValue) -> Waiting | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not all(
            isinstance(raw.get(key), str) for key in ("id", "callId", "toolName")) \
            or type(raw.get("askedAt")) is not int:
        raise CodecError("an approval book's waiting question needs id, callId and toolName "
                         "strings and an integer askedAt")
    return Waiting(raw["id"], raw["callId"], raw["toolName"], raw["askedAt"])


def scan_approvals(events: Iterable[Event]) -> ApprovalBook:
    book = ApprovalBook()
    for event in events:
        book.advance(event)
    return book


def verdict_text(data: Mapping[str, JsonValue]) -> str:
    """How a decision reads in a refusal: ``approved by {...} (message m1)``."""
    decision = {"approve": "approved", "deny": "denied", "timeout": "timed out",
                "cancel": "cancelled with its turn", "policy": "rejected by the session's "
                "approval policy"}.get(str(data.get("decision")), str(data.get("outcome")))
    text = decision
    if data.get("by") is not None:
        text += f" by {_who(data['by'])}"
    if isinstance(data.get("messageId"), str):
        text += f" (message {data['messageId']})"
    return text


def _who(by: JsonValue) -> str:
    if isinstance(by, Mapping):
        name = by.get("name") or by.get("id")
        return f"{by.get('kind', '?')} {name}" if name else str(by.get("kind", "?"))
    return str(by)


def decision_data(waiting: Waiting, outcome: str, decision: str, *,
                  message_id: str | None = None, by: JsonValue = None,
                  reason: str | None = None) -> dict[str, JsonValue]:
    """The :data:`DECISION_TYPE` data: who decided a question, how and why."""
    data: dict[str, JsonValue] = {"id": waiting.id, "callId": waiting.call_id,
                                  "outcome": outcome, "decision": decision}
    if message_id is not None:
        data["messageId"] = message_id
    if by is not None:
        data["by"] = by
    if reason is not None:
        data["reason"] = reason
    return data


def denial_text(tool_name: str, decision: str, reason: str | None,
                timeout_ms: int | None) -> tuple[str, str]:
    """(text the model sees, error code) for a call that will not run."""
    if decision == "timeout":
        seconds = (timeout_ms or 0) / 1000
        return (f'Error: approval for tool "{tool_name}" timed out after {seconds:g} s; '
                "the call did not run", "APPROVAL_TIMEOUT")
    if decision == "cancel":
        return (f'Error: approval for tool "{tool_name}" was cancelled; the call did not run',
                "TOOL_CANCELED")
    if decision == "policy":
        return (f'Error: tool "{tool_name}" requires approval, and approval prompts are '
                "disabled in this session (policy never); the call did not run",
                "APPROVAL_REJECTED")
    text = f'Error: the user rejected tool "{tool_name}"'
    return (f"{text}: {reason}" if reason else text), "APPROVAL_REJECTED"


def waiting_approval(events: Iterable[Event]) -> Waiting | None:
    """The question the log's open turn waits on, or None (no open turn, or not waiting)."""
    return scan_approvals(events).waiting
