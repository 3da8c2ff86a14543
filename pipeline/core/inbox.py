"""Inbox commands and the two inbox lists of a session (sans-I/O).

A session's inbox has two lists, as in dsh: *next-turn* (follow-ups; one is claimed per turn)
and *next-step* (steering and injected context; all are claimed at the next step boundary).
Every change of a list is logged as an ``agent/inbox/spliced`` event, exactly as dsh writes it:

- a command entering a list: ``{target, start, inserted:[message]}`` (``start`` = its index);
- a claim: ``{target, start:0, removedCount:n, inserted:[]}``;
- a cancel that drops queued items: the same with ``outcome:"canceled"``.

Because the lists are logged, they are rebuilt from the log after a restart
(:meth:`InboxLists.apply_splice`), so pending work survives a crash with no other state.

Commands (frozen dataclasses, one per kind of ``dsh.inbox`` record): :class:`FollowUp` (next
turn, wakes the driver), :class:`Steer` (next step, wakes), :class:`Inject` (next step, does
not wake), :class:`Cancel`, :class:`Configure`, and :class:`Approve` / :class:`Deny` (a
person's decision on a tool call waiting for approval, :mod:`pipeline.core.approvals`).
:func:`command_from_json` / :func:`command_to_json` are the JSON form (the Avro schema of the
inbox topic mirrors it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Final, Literal, TypeAlias

from pipeline.core.errors import CodecError, ConfigError, EventError
from pipeline.core.events import JsonValue, dumps_json
from pipeline.core.tenants import checked_tenant

NEXT_TURN: Final = "next-turn"
NEXT_STEP: Final = "next-step"
Target: TypeAlias = Literal["next-turn", "next-step"]
SPLICE_TYPE: Final = "agent/inbox/spliced"
USER_SOURCE: Final[Mapping[str, JsonValue]] = {"kind": "user"}
CONTEXT_SOURCE: Final[Mapping[str, JsonValue]] = {"kind": "context"}


def _bad(kind: str, message: str) -> EventError:
    return EventError(message, type=f"inbox/{kind}", rule="inbox-command")


def _check_ids(kind: str, session_id: str, message_id: str) -> None:
    if not isinstance(session_id, str) or not session_id:
        raise _bad(kind, "session_id must be a non-empty string")
    if not isinstance(message_id, str) or not message_id:
        raise _bad(kind, "message_id must be a non-empty string")


def _check_tenant(kind: str, tenant: str | None) -> None:
    if tenant is None:
        return
    try:
        checked_tenant(tenant)
    except ConfigError as exc:
        raise _bad(kind, str(exc)) from None


def _check_content(kind: str, content: Sequence[JsonValue]) -> None:
    if not isinstance(content, Sequence) or isinstance(content, str) or not content:
        raise _bad(kind, "content must be a non-empty list of content blocks")
    for index, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise _bad(kind, f"content[{index}] must be an object with a string 'type'")


@dataclass(frozen=True, slots=True)
class _MessageCommand:
    """A command that carries one user message into one of the two inbox lists."""

    session_id: str
    message_id: str
    content: tuple[JsonValue, ...]
    source: Mapping[str, JsonValue] | None = None
    tenant: str | None = None  # None: not stated (see pipeline.core.tenants)

    kind: ClassVar[str] = "message"
    target: ClassVar[Target] = NEXT_STEP
    wakes: ClassVar[bool] = True
    default_source: ClassVar[Mapping[str, JsonValue]] = USER_SOURCE

    def __post_init__(self) -> None:
        _check_ids(self.kind, self.session_id, self.message_id)
        _check_tenant(self.kind, self.tenant)
        _check_content(self.kind, self.content)
        if self.source is not None and not (isinstance(self.source, Mapping)
                                            and isinstance(self.source.get("kind"), str)):
            raise _bad(self.kind, "source must be an object with a string 'kind'")

    def message(self) -> dict[str, JsonValue]:
        """The user message as it enters the log (``user/message`` data, splice item)."""
        return {
            "id": self.message_id, "role": "user", "content": list(self.content),
            "source": dict(self.source if self.source is not None else self.default_source),
        }


@dataclass(frozen=True, slots=True)
class FollowUp(_MessageCommand):
    """A follow-up: queued for the next turn; wakes the driver."""

    kind: ClassVar[str] = "followup"
    target: ClassVar[Target] = NEXT_TURN
    wakes: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class Steer(_MessageCommand):
    """Steering: enters at the next step boundary (of this turn, or a new one); wakes."""

    kind: ClassVar[str] = "steer"
    target: ClassVar[Target] = NEXT_STEP
    wakes: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class Inject(_MessageCommand):
    """Injected context: enters at the next step boundary; waits for something else to wake.

    Its message's source defaults to ``{kind:"context"}`` (not ``user``): that is how a
    rebuilt inbox tells it from a steer, which must still wake after a restart.
    """

    kind: ClassVar[str] = "inject"
    target: ClassVar[Target] = NEXT_STEP
    wakes: ClassVar[bool] = False
    default_source: ClassVar[Mapping[str, JsonValue]] = CONTEXT_SOURCE


@dataclass(frozen=True, slots=True)
class Cancel:
    """Abort the current turn (if any); unless ``keep_queue``, drop every queued item too."""

    session_id: str
    message_id: str
    keep_queue: bool = False
    tenant: str | None = None

    kind: ClassVar[str] = "cancel"

    def __post_init__(self) -> None:
        _check_ids(self.kind, self.session_id, self.message_id)
        _check_tenant(self.kind, self.tenant)


@dataclass(frozen=True, slots=True)
class Configure:
    """Change the request configuration; ``None`` leaves a field as it is.

    ``tools`` names tools of the driver's registry (``()`` = no tools). Applying it logs the
    whole configuration in force at once as a ``dsh-pipeline/config`` event (ignorable; see
    :mod:`pipeline.core.turn_config`), and the next model request states it again in its
    ``request/header`` (reason ``change``).
    """

    session_id: str
    message_id: str
    provider: str | None = None
    model: str | None = None
    system: str | None = None
    tools: tuple[str, ...] | None = None
    reasoning_effort: str | None = None
    max_tokens: int | None = None
    require_approval: tuple[str, ...] | None = None  # the session's approval globs
    approval_policy: str | None = None  # "ask" | "never" (an ``approval/policy`` event)
    tenant: str | None = None

    kind: ClassVar[str] = "configure"

    def __post_init__(self) -> None:
        _check_ids(self.kind, self.session_id, self.message_id)
        _check_tenant(self.kind, self.tenant)
        for name in ("provider", "model"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(self.kind, f"{name} must be a non-empty string when given")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
            or self.max_tokens <= 0
        ):
            raise _bad(self.kind, f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.tools is not None and not all(isinstance(t, str) and t for t in self.tools):
            raise _bad(self.kind, "tools must be a list of tool names")
        if self.require_approval is not None and not all(
                isinstance(p, str) and p for p in self.require_approval):
            raise _bad(self.kind, "requireApproval must be a list of tool-name patterns")
        if self.approval_policy not in (None, "ask", "never"):
            raise _bad(self.kind, f"approvalPolicy must be ask or never, got "
                                  f"{self.approval_policy!r}")


@dataclass(frozen=True, slots=True)
class Approve:
    """A person lets a tool call waiting for approval run (once). ``source`` says who
    (``{kind, name?}``; absent: ``{kind:"user"}``), ``reason`` why; both go to the log."""

    session_id: str
    message_id: str
    call_id: str
    reason: str | None = None
    source: Mapping[str, JsonValue] | None = None
    tenant: str | None = None

    kind: ClassVar[str] = "approve"

    def __post_init__(self) -> None:
        _check_ids(self.kind, self.session_id, self.message_id)
        _check_tenant(self.kind, self.tenant)
        if not isinstance(self.call_id, str) or not self.call_id:
            raise _bad(self.kind, "callId must be a non-empty string")
        if self.reason is not None and not isinstance(self.reason, str):
            raise _bad(self.kind, "reason must be a string")
        if self.source is not None and not (isinstance(self.source, Mapping)
                                            and isinstance(self.source.get("kind"), str)):
            raise _bad(self.kind, "source must be an object with a string 'kind'")


@dataclass(frozen=True, slots=True)
class Deny(Approve):
    """A person refuses a tool call waiting for approval: the model gets an error result
    with the ``reason``."""

    kind: ClassVar[str] = "deny"


MessageCommand: TypeAlias = FollowUp | Steer | Inject
InboxCommand: TypeAlias = FollowUp | Steer | Inject | Cancel | Configure | Approve | Deny
_MESSAGE_KINDS: Final[dict[str, type[FollowUp] | type[Steer] | type[Inject]]] = {
    "followup": FollowUp, "steer": Steer, "inject": Inject,
}
_CONFIG_FIELDS: Final = {
    "provider": "provider", "model": "model", "system": "system", "tools": "tools",
    "reasoningEffort": "reasoning_effort", "maxTokens": "max_tokens",
    "requireApproval": "require_approval", "approvalPolicy": "approval_policy",
}
_LIST_FIELDS: Final = ("tools", "require_approval")


def with_tenant(command: InboxCommand, tenant: str) -> InboxCommand:
    """``command`` with ``tenant`` stated (a service's header); :class:`EventError` when it
    already states another one or the name is not valid."""
    if command.tenant is None:
        return replace(command, tenant=tenant)
    if command.tenant != tenant:
        raise _bad(command.kind, f"the record's tenant header names {tenant!r}, its tenant "
                                 f"field {command.tenant!r}")
    return command


def command_to_json(command: InboxCommand) -> dict[str, JsonValue]:
    """The JSON form: ``{kind, sessionId, messageId, ...}`` (camelCase like the log)."""
    out: dict[str, JsonValue] = {
        "kind": command.kind, "sessionId": command.session_id, "messageId": command.message_id,
    }
    if isinstance(command, FollowUp | Steer | Inject):
        out["content"] = list(command.content)
        if command.source is not None:
            out["source"] = dict(command.source)
    elif isinstance(command, Cancel):
        out["keepQueue"] = command.keep_queue
    elif isinstance(command, Approve):
        out["callId"] = command.call_id
        if command.reason is not None:
            out["reason"] = command.reason
        if command.source is not None:
            out["source"] = dict(command.source)
    else:
        for key, attr in _CONFIG_FIELDS.items():
            value = getattr(command, attr)
            if value is not None:
                out[key] = list(value) if attr in _LIST_FIELDS else value
    if command.tenant is not None:
        out["tenant"] = command.tenant
    return out


def command_from_json(obj: JsonValue) -> InboxCommand:
    """Parse the JSON form; raises :class:`EventError` naming the field that is wrong."""
    if not isinstance(obj, Mapping):
        raise _bad("?", "an inbox command must be a JSON object")
    kind = obj.get("kind")
    common: dict[str, Any] = {
        "session_id": obj.get("sessionId"), "message_id": obj.get("messageId"),
        "tenant": obj.get("tenant"),
    }
    if common["tenant"] is not None and not isinstance(common["tenant"], str):
        raise _bad(str(kind), "tenant must be a string")
    if kind in _MESSAGE_KINDS:
        content = obj.get("content")
        if not isinstance(content, list):
            raise _bad(str(kind), "content must be a list of content blocks")
        return _MESSAGE_KINDS[str(kind)](**common, content=tuple(content),
                                         source=obj.get("source"))
    if kind == "cancel":
        keep = obj.get("keepQueue", False)
        if not isinstance(keep, bool):
            raise _bad("cancel", "keepQueue must be a boolean")
        return Cancel(**common, keep_queue=keep)
    if kind == "configure":
        fields = {attr: obj[key] for key, attr in _CONFIG_FIELDS.items() if key in obj}
        for name in _LIST_FIELDS:
            if name in fields:
                if not isinstance(fields[name], list):
                    raise _bad("configure", f"{name} must be a list of strings")
                fields[name] = tuple(fields[name])
        return Configure(**common, **fields)
    if kind in ("approve", "deny"):
        decision = Approve if kind == "approve" else Deny
        common["call_id"] = obj.get("callId")  # checked by the command itself
        return decision(**common, reason=obj.get("reason"), source=obj.get("source"))
    raise _bad(str(kind), f"unknown command kind {dumps_json(kind)[:40]}; expected one of "
                          "followup, steer, inject, cancel, configure, approve, deny")


@dataclass(slots=True)
class InboxItem:
    """A queued message; ``wakes`` is False for injected context."""

    message: dict[str, JsonValue]
    wakes: bool


@dataclass(slots=True)
class InboxLists:
    """The two inbox lists; every mutation returns the splice data to log for it."""

    next_turn: list[InboxItem] = field(default_factory=list)
    next_step: list[InboxItem] = field(default_factory=list)

    def _list(self, target: str) -> list[InboxItem]:
        return self.next_turn if target == NEXT_TURN else self.next_step

    def insert(self, command: MessageCommand) -> dict[str, JsonValue]:
        queue = self._list(command.target)
        message = command.message()
        queue.append(InboxItem(message, command.wakes))
        return {"target": command.target, "start": len(queue) - 1, "inserted": [message]}

    @property
    def wakes(self) -> bool:
        """True when something queued asks for a turn (a follow-up or a steer)."""
        return bool(self.next_turn) or any(item.wakes for item in self.next_step)

    @property
    def steered(self) -> bool:
        """True when a waking next-step item (a steer) waits: the turn goes on for it."""
        return any(item.wakes for item in self.next_step)

    def claim_next_step(self) -> tuple[list[dict[str, JsonValue]], dict[str, JsonValue] | None]:
        """Claim every next-step item: their messages and the splice, or ``([], None)``."""
        return self._remove(NEXT_STEP, len(self.next_step), outcome=None)

    def claim_next_turn(self) -> tuple[list[dict[str, JsonValue]], dict[str, JsonValue] | None]:
        """Claim exactly one next-turn item (the oldest)."""
        return self._remove(NEXT_TURN, min(1, len(self.next_turn)), outcome=None)

    def cancel_all(self) -> list[dict[str, JsonValue]]:
        """Drop everything queued; the splices to log (``outcome:"canceled"``)."""
        splices = []
        for target in (NEXT_TURN, NEXT_STEP):
            _, splice = self._remove(target, len(self._list(target)), outcome="canceled")
            if splice is not None:
                splices.append(splice)
        return splices

    def _remove(self, target: str, count: int, *, outcome: str | None
                ) -> tuple[list[dict[str, JsonValue]], dict[str, JsonValue] | None]:
        if count == 0:
            return [], None
        queue = self._list(target)
        removed = [item.message for item in queue[:count]]
        del queue[:count]
        splice: dict[str, JsonValue] = {
            "target": target, "start": 0, "removedCount": count, "inserted": [],
        }
        if outcome is not None:
            splice["outcome"] = outcome
        return removed, splice

    def apply_splice(self, data: JsonValue, *, seq: int) -> None:
        """Fold a logged splice (rebuild after a restart).

        The log does not say which next-step item came from a steer: a rebuilt next-step item
        wakes when its message's source kind is ``user`` (steering is the user's; injected
        context has another source kind, ``context`` by default), as in dsh.
        """
        if not isinstance(data, Mapping) or data.get("target") not in (NEXT_TURN, NEXT_STEP):
            raise EventError("splice data needs target next-turn or next-step", seq=seq,
                             type=SPLICE_TYPE, rule="inbox-splice")
        queue = self._list(str(data["target"]))
        start = data.get("start", 0)
        removed = data.get("removedCount", 0)
        inserted = data.get("inserted", [])
        if not (isinstance(start, int) and isinstance(removed, int) and isinstance(inserted, list)
                and all(isinstance(m, Mapping) for m in inserted)
                and 0 <= start <= len(queue) and 0 <= removed <= len(queue) - start):
            raise EventError(f"splice start/removedCount/inserted do not fit a list of "
                             f"{len(queue)} items", seq=seq, type=SPLICE_TYPE,
                             rule="inbox-splice")
        turn = data["target"] == NEXT_TURN
        queue[start:start + removed] = [InboxItem(dict(m), turn or _from_user(m))
                                        for m in inserted]


    def to_json(self) -> dict[str, JsonValue]:
        """``{nextTurn, nextStep}``, each a list of ``{message, wakes}``: ``wakes`` is kept as
        it is (an item inserted live may not wake the way a rebuilt one would)."""
        return {"nextTurn": [{"message": i.message, "wakes": i.wakes} for i in self.next_turn],
                "nextStep": [{"message": i.message, "wakes": i.wakes} for i in self.next_step]}

    @classmethod
    def from_json(cls, raw: JsonValue) -> InboxLists:
        """The lists :meth:`to_json` gave (fresh items); :class:`CodecError` if they do
        not fit."""
        if not isinstance(raw, Mapping):
            raise CodecError("inbox lists must be a JSON object {nextTurn, nextStep}")
        return cls(next_turn=_items(raw.get("nextTurn")), next_step=_items(raw.get("nextStep")))


def _items(raw: JsonValue) -> list[InboxItem]:
    if not isinstance(raw, list) or not all(
            isinstance(item, Mapping) and isinstance(item.get("message"), Mapping)
            and isinstance(item.get("wakes"), bool) for item in raw):
        raise CodecError("an inbox list must be a list of {message: object, wakes: boolean}")
    return [InboxItem(dict(item["message"]), item["wakes"]) for item in raw]


def _from_user(message: Mapping[str, JsonValue]) -> bool:
    source = message.get("source")
    return isinstance(source, Mapping) and source.get("kind") == "user"
