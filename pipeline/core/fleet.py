"""Fleet status: per session, where it is (idle or in a turn, which step), and fleet counters.

Folded from the boundary events (``turn/*``, ``step/*``, read with the lifecycle's own
:func:`~pipeline.core.lifecycle.declared_number` and
:func:`~pipeline.core.lifecycle.end_reason_kind`), errors (``turn/end`` with an error
reason, ``tool/result`` with an error, ``llm/retry``), approvals (``approval/asked`` until its
``approval/decided``: the call waiting for a person) and the time of every folded event.
The session's tenant (its ``dsh-pipeline/tenant`` event) and a step waiting for a provider's
budget (from ``dsh-pipeline/provider-wait`` until its ``dsh-pipeline/provider-granted``, or
the step's or turn's end) are folded too. ``assistant/chunk`` events are not folded here
(the processors skip them by header without decoding), so ``last_activity_ms`` is the time
of the last non-chunk event.

The row keeps its own view of the lifecycle (``state``, ``turn``, ``step``,
``last_end_reason``) rather than a :class:`~pipeline.core.lifecycle.Lifecycle`: the row is
the persisted value (``dsh.FleetStatus``), restored from the table with no fold behind it, and
it is read by people, so a ``step/start`` whose ``turn/start`` it never saw shows the session
in that turn, and a turn with no number shows none (the fold would count one on).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Final

from pipeline.core.events import Event, JsonValue
from pipeline.core.lifecycle import (
    STEP_END,
    STEP_START,
    TURN_END,
    TURN_START,
    declared_number,
    end_reason_kind,
)
from pipeline.core.rate_budget import PROVIDER_GRANTED_TYPE, PROVIDER_WAIT_TYPE
from pipeline.core.tenants import DEFAULT_TENANT, TENANT_TYPE, folded_tenant

IDLE: Final = "idle"
IN_TURN: Final = "in-turn"


@dataclass(slots=True)
class FleetStatus:
    """One session's live status (the value of the fleet table and of ``dsh.fleet``)."""

    session_id: str
    state: str = IDLE
    turn: int | None = None
    step: int | None = None
    last_end_reason: str | None = None
    last_error: str | None = None
    last_activity_ms: int | None = None
    last_seq: int = -1
    turns: int = 0
    steps: int = 0
    turn_errors: int = 0
    tool_errors: int = 0
    retries: int = 0
    approval_call_id: str | None = None  # the call waiting for a person's approval
    approval_tool: str | None = None
    approval_since_ms: int | None = None
    tenant: str = DEFAULT_TENANT  # pipeline.core.tenants
    provider_wait: str | None = None  # "provider/model" whose budget a step waits for
    provider_wait_since_ms: int | None = None

    def apply(self, event: Event) -> bool:
        """Fold one event; True when the status is worth publishing: after every event but a
        streamed chunk (the many), so a published status is exact once its session rests."""
        data = event.data if isinstance(event.data, Mapping) else {}
        self.last_seq = event.seq
        self.last_activity_ms = event.time
        handler = _HANDLERS.get(event.type)
        if handler is not None:
            handler(self, data)

        return event.type != CHUNK_TYPE

    def to_json(self) -> dict[str, JsonValue]:
        # Hand-written, not dataclasses.asdict: this runs once per folded event.
        return {name: getattr(self, name) for name in _STATUS_FIELDS}

    @classmethod
    def from_json(cls, raw: Mapping[str, JsonValue]) -> FleetStatus:
        return cls(**raw)


CHUNK_TYPE: Final = "assistant/chunk"
_STATUS_FIELDS: Final = tuple(f.name for f in fields(FleetStatus))


def _turn_start(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    status.state, status.turn, status.step = IN_TURN, declared_number(data, "turn"), None
    status.turns += 1


def _turn_end(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    status.state, status.step = IDLE, None
    _approval_closed(status, data)
    reason = data.get("reason")
    status.last_end_reason = end_reason_kind(reason)
    if status.last_end_reason == "error" and isinstance(reason, Mapping):
        error = reason.get("error")
        code = error.get("code") if isinstance(error, Mapping) else None
        status.last_error = str(code) if code is not None else "error"
        status.turn_errors += 1


def _step_start(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    status.state = IN_TURN
    status.turn = declared_number(data, "turn") or status.turn
    status.step = declared_number(data, "step")
    status.steps += 1


def _step_end(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    status.step = None


def _tool_result(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    error = data.get("error")
    if isinstance(error, Mapping):
        status.tool_errors += 1
        code = error.get("code")
        status.last_error = str(code) if code is not None else "tool-error"


def _retry(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    status.retries += 1


def _approval_asked(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    call_id, tool = data.get("callId"), data.get("toolName")
    status.approval_call_id = call_id if isinstance(call_id, str) else "?"
    status.approval_tool = tool if isinstance(tool, str) else None
    status.approval_since_ms = status.last_activity_ms  # the asking event's time


def _approval_closed(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    status.approval_call_id = status.approval_tool = status.approval_since_ms = None


def _tenant(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    status.tenant = folded_tenant(status.tenant, data)


def _provider_wait(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    provider, model = data.get("provider"), data.get("model")
    status.provider_wait = f"{provider}/{model}"
    status.provider_wait_since_ms = status.last_activity_ms  # the waiting event's time


def _provider_granted(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    status.provider_wait = status.provider_wait_since_ms = None


def _step_closed(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    _step_end(status, data)
    _provider_granted(status, data)  # a step that ended waits for nothing


def _turn_closed(status: FleetStatus, data: Mapping[str, JsonValue]) -> None:
    _turn_end(status, data)
    _provider_granted(status, data)


_HANDLERS: Final = {
    TURN_START: _turn_start, TURN_END: _turn_closed, STEP_START: _step_start,
    STEP_END: _step_closed, "tool/result": _tool_result, "llm/retry": _retry,
    "approval/asked": _approval_asked, "approval/decided": _approval_closed,
    TENANT_TYPE: _tenant, PROVIDER_WAIT_TYPE: _provider_wait,
    PROVIDER_GRANTED_TYPE: _provider_granted,
}


@dataclass(frozen=True, slots=True)
class FleetCounters:
    """Counters over a set of sessions at a moment ``now_ms`` given by the caller."""

    sessions: int
    active_sessions: int
    turns_in_flight: int
    steps_in_flight: int
    turn_errors: int
    steps_per_second: float
    pending_approvals: int = 0  # sessions whose tool call waits for a person

    def to_json(self) -> dict[str, JsonValue]:
        return asdict(self)


def fleet_counters(statuses: Iterable[FleetStatus], *, now_ms: int, active_within_ms: int,
                   steps_per_second: float = 0.0) -> FleetCounters:
    """Active = in a turn, or any activity within ``active_within_ms`` before ``now_ms``."""
    sessions = active = turns = steps = errors = approvals = 0
    for status in statuses:
        sessions += 1
        recent = (status.last_activity_ms is not None
                  and now_ms - status.last_activity_ms <= active_within_ms)
        active += status.state == IN_TURN or recent
        turns += status.state == IN_TURN
        steps += status.step is not None
        errors += status.turn_errors
        approvals += status.approval_call_id is not None
    return FleetCounters(sessions, active, turns, steps, errors, steps_per_second, approvals)


@dataclass(slots=True)
class StepRate:
    """Steps per second over a sliding span: fed ``(now_ms, steps started)`` observations."""

    span_ms: int = 10_000
    _samples: deque[tuple[int, int]] = field(default_factory=deque)
    _total: int = 0

    def observe(self, now_ms: int, new_steps: int) -> None:
        self._total += new_steps
        self._samples.append((now_ms, self._total))
        while len(self._samples) > 2 and now_ms - self._samples[0][0] > self.span_ms:
            self._samples.popleft()

    def per_second(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return 0.0 if t1 <= t0 else (n1 - n0) * 1000.0 / (t1 - t0)
