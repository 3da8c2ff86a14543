"""The turn state machine of one session: sans-I/O, no clock, no randomness.

Modelled on httpx's auth flow: the caller (the driver's runner) asks :meth:`next_effect` what to
do, performs it (:mod:`pipeline.core.turn_effects`), and reports back through a method
(:meth:`hooks_done`, :meth:`chunk`, :meth:`stream_ended`, :meth:`stream_failed`,
:meth:`sleep_done`, :meth:`tool_started`, :meth:`tool_finished`). Time always comes in as an
argument.

**Events.** The machine appends every event itself, through the session's
:class:`~pipeline.core.log.SessionLog` (strict validation, seq stamped from ``log.next_seq``,
the caller's time): an event that breaks a rule is refused before anything is published, and
``sourceEventSeqs`` (chunk seqs, tool/call seqs) are known when they are needed. The caller
takes the appended events with :meth:`take_events` and publishes them; nothing else may append
to the log while a machine drives it.

**Configuration**: an applied ``configure`` appends a ``dsh-pipeline/config`` event
(ignorable) at once, so the log alone restores it (:mod:`pipeline.core.turn_config`).

**Lifecycle** (DESIGN.md section 1, the fixtures event for event): at a turn boundary
``turn/start``, the claim of every next-step item then of one next-turn item (each an
``agent/inbox/spliced``), the pre-step hooks, ``step/start``, one ``user/message`` per entering
message, ``request/header`` (+ ``request/context``) when the header changed, one
``assistant/chunk`` per stream chunk, ``assistant/message`` (sources: that attempt's chunk seqs),
``tool/call`` as each call starts, ``tool/result`` in model order, ``step/end``; tool calls or a
waiting steer -> another step; else ``turn/end completed``.

**Approvals**: a call an approval rule gates logs ``approval/asked`` after its ``tool/call``
and the turn waits (:class:`AwaitApproval`) for :meth:`submit` of an approve or deny, a cancel
or :meth:`expire_approval` (:mod:`pipeline.core.turn_approvals`).

**The invariant**: a request is built only from ``log.messages()`` and the last logged header,
and :meth:`check_request` refuses (``InvariantViolation``) any request that differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

from pipeline.core.approvals import POLICY, ApprovalRules
from pipeline.core.errors import TurnError
from pipeline.core.events import APPEND, Event, JsonValue
from pipeline.core.inbox import (
    SPLICE_TYPE,
    Approve,
    Cancel,
    Configure,
    FollowUp,
    InboxCommand,
    InboxLists,
    Inject,
    Steer,
)
from pipeline.core.log import SessionLog
from pipeline.core.model import RetryPolicy, StreamAccumulator
from pipeline.core.repair import repair_closers
from pipeline.core.tenants import TENANT_TYPE, command_tenant_error, tenant_event_data
from pipeline.core.turn_approvals import ApprovalGate
from pipeline.core.turn_config import CONFIG_TYPE, ConfigState
from pipeline.core.turn_effects import (
    TOOL_CANCELED,
    Effect,
    HookDecision,
    Idle,
    RunPreStepHooks,
    SessionConfig,
    Sleep,
    StepBoundary,
)
from pipeline.core.turn_history import History, scan_history
from pipeline.core.turn_machine_routes import RoutesPhase
from pipeline.core.turn_machine_stream import StreamPhase
from pipeline.core.turn_machine_tools import Phase, ToolsPhase
from pipeline.core.turn_requests import error_reason
from pipeline.core.turn_tools import ToolRound, calls_of
from pipeline.core.validation import validate_event

NO_MODEL: Final = "NO_MODEL_CONFIGURED"
_CANCELED_TEXT: Final = "The tool call was canceled before it started; it did not run."


class TurnMachine(ToolsPhase, RoutesPhase, StreamPhase):
    """Drives one session's turns over its :class:`SessionLog`: the turn's lifecycle, the
    inbox and aborts here; the model call in :class:`StreamPhase`, the tools in
    :class:`ToolsPhase`, the routes in :class:`RoutesPhase` (mixins kept apart for size)."""

    def __init__(self, log: SessionLog, *, new_id: Callable[[], str],
                 config: SessionConfig | None = None,
                 retry: RetryPolicy | None = None, approvals: ApprovalRules | None = None,
                 history: History | None = None, routing: bool = False) -> None:
        """``history``: the session's past as folded up to ``log.next_seq`` (a restored
        checkpoint's, :mod:`pipeline.core.checkpoint`); None: scanned from ``log.events``,
        which must then be the whole log. The machine takes it over (its inbox and id sets
        change as the session goes on). ``routing``: ask :class:`ChooseRoute` at each step
        (:mod:`pipeline.core.turn_machine_routes`); else calls take the configured model."""
        if history is None and len(log.events) != log.next_seq:
            raise TurnError(f"session {log.session_id!r}: a bounded log that no longer holds "
                            "every event needs the History folded with it")
        self.log = log
        self._new_id = new_id
        self._retry = retry or RetryPolicy()
        if history is None:
            history = scan_history(log.events)
        self.inbox: InboxLists = history.inbox
        self._seen_ids: set[str] = history.message_ids
        self._turn = history.last_turn
        self.tenant = history.tenant
        # a session's own logged configuration wins over the caller's default
        self._config = ConfigState(header=history.header, configured=history.configured,
                                   configured_last=history.configured_last,
                                   message_ids=history.configure_ids, default=config,
                                   route=history.route)
        self._routing = routing
        if not routing:  # a fallback a former owner logged: back on the configured model
            self._config.set_route(None)
        self._gate = ApprovalGate(approvals or ApprovalRules(), history.approvals)
        self._outbox: list[Event] = []
        self._repaired = False
        self.phase = Phase.IDLE
        self._abort_reason: dict[str, JsonValue] | None = None
        self._boundary = False
        self._reset_turn()

    # -- bookkeeping --------------------------------------------------------------------

    def _reset_turn(self) -> None:
        self._step = 0
        self._end_reason: dict[str, JsonValue] | None = None
        self._had_tool_calls = False
        self._reset_attempt(1)
        self._tools = ToolRound()

    def _reset_attempt(self, attempt: int) -> None:
        self._attempt = attempt
        if attempt == 1:
            self._route_start = 1
        self._acc = StreamAccumulator()
        self._chunk_seqs: list[int] = []
        self._replay_state: JsonValue = None
        self._retry_delay: int | None = None
        self._asked: tuple[str, str] = ("", "")

    def _append(self, type_: str, data: JsonValue, now: int, *, surface: bool = False,
                sources: Iterable[int] | None = None, ignorable: bool | None = None) -> int:
        event = Event(type_, self.log.next_seq, now, data, APPEND if surface else None,
                      None if sources is None else tuple(sources), ignorable)
        self.log.append(event)
        self._outbox.append(event)
        return event.seq

    def note(self, type_: str, data: JsonValue, now: int) -> None:
        """Log an ignorable ``dsh-pipeline/`` event the caller observed (e.g. a wait for a
        provider's budget); it changes nothing the machine decides."""
        if not type_.startswith("dsh-pipeline/"):
            raise TurnError(f"a note must be a dsh-pipeline/ event, not {type_!r}")
        self._append(type_, data, now, ignorable=True)

    def take_events(self) -> list[Event]:
        """The events appended since the last call, in seq order (for the caller to publish)."""
        events, self._outbox = self._outbox, []
        return events

    @property
    def turn(self) -> int:
        return self._turn

    @property
    def config(self) -> SessionConfig | None:
        return self._config.config

    @property
    def busy(self) -> bool:
        """A turn is open (or a boundary still has to be reported)."""
        return self.phase is not Phase.IDLE

    # -- crash repair ---------------------------------------------------------------------

    def recover(self, now: int) -> bool:
        """Close the log's open turn (crash repair) if it has one; True if closers were written.

        Called implicitly before anything else is appended, so a repaired log is the only
        thing a machine ever extends.
        """
        if self._repaired:
            return False
        self._repaired = True
        if not self.log.turn.in_turn or self._resume_wait():
            return False
        for closer in repair_closers(self.log, now):
            self.log.append(closer)
            self._outbox.append(closer)
        self._boundary = True
        return True

    # -- inbox ----------------------------------------------------------------------------

    def submit(self, command: InboxCommand, now: int, *,
               tools: tuple[JsonValue, ...] | None = None) -> bool:
        """Take one inbox command; False if it was a duplicate (already in the log).

        A configure is logged at once as a ``dsh-pipeline/config`` event (ignorable), also in
        the middle of a turn: the machine applies it at once (the next model request uses
        it, the one in flight does not), and the driver commits its inbox offset with the
        events logged so far, so the log must hold it from this seq on for a rebuild at any
        later point (crash repair included) to restore the same configuration.

        ``tools`` are the resolved definitions of a :class:`Configure`'s tool names.
        """
        self.recover(now)
        self._enter_tenant(command, now)
        if isinstance(command, FollowUp | Steer | Inject):
            if command.message_id in self._seen_ids:
                return False
            self._check_messages((command.message(),))  # refused here, not at claim time
            self._seen_ids.add(command.message_id)
            self._append(SPLICE_TYPE, self.inbox.insert(command), now)
        elif isinstance(command, Cancel):
            if not command.keep_queue:
                for splice in self.inbox.cancel_all():
                    self._append(SPLICE_TYPE, splice, now)
            self.abort("user")
        elif isinstance(command, Configure):
            if command.message_id in self._config.message_ids:
                return False
            self._configure(command, tools, now)
        elif isinstance(command, Approve):  # a Deny too
            if command.message_id in self._gate.book.message_ids:
                return False
            decided = self._gate.decide(command, now, self._gate_append)
            if decided is not None:
                self._decided(*decided, now)
        return True

    def _enter_tenant(self, command: InboxCommand, now: int) -> None:
        """The first command of a session puts it in its tenant (a tenant event before any
        other); a later one naming another tenant is refused (``TurnError``), changing
        nothing."""
        if command.tenant is None or command.tenant == self.tenant:
            return
        if self.log.next_seq == 0:
            self._append(TENANT_TYPE, tenant_event_data(command.tenant, command.message_id),
                         now, ignorable=True)
            self.tenant = command.tenant
            return
        refused = command_tenant_error(self.tenant, command.tenant, self.log.session_id)
        assert refused is not None  # the tenants differ
        raise TurnError(refused)

    def _configure(self, command: Configure, tools: tuple[JsonValue, ...] | None,
                   now: int) -> None:
        data = self._config.configure(command, tools)
        if command.require_approval is not None:
            data["requireApproval"] = list(command.require_approval)
            self._gate.book.require = command.require_approval
        self._append(CONFIG_TYPE, data, now, ignorable=True)
        policy = command.approval_policy
        if policy is not None and policy != self._gate.book.effective_policy(self._gate.rules):
            self._append(POLICY, {"policy": policy}, now)  # dsh: a switch, not a repeat
            self._gate.book.policy = policy

    # -- the loop -------------------------------------------------------------------------

    def next_effect(self, now: int) -> Effect:
        """What the caller must do next. Appends whatever the decision logs."""
        self.recover(now)
        if self._boundary:
            self._boundary = False
            return StepBoundary()
        if self._abort_reason is not None:
            return self._abort(self._abort_reason, now)
        if self.phase is Phase.IDLE:
            if not self.inbox.wakes:
                return Idle()
            self._start_turn(now)
        if self.phase is Phase.CLAIM:
            return self._claim(now)
        if self.phase is Phase.ROUTE:
            return self._ask_route()
        if self.phase is Phase.CALL:
            return self._call_model()
        if self.phase is Phase.RETRY_WAIT and self._retry_delay is not None:
            delay, self._retry_delay = self._retry_delay, None
            return Sleep(delay)
        if self.phase is Phase.TOOLS:
            return self._tools_effect(now)
        if self.phase is Phase.AFTER_STEP:
            return self._after_step(now)
        raise TurnError(f"next_effect called while waiting for a result (phase {self.phase.name})")

    def _start_turn(self, now: int) -> None:
        self._reset_turn()
        self._turn += 1
        self._append("turn/start", {"turn": self._turn}, now)
        self.phase = Phase.CLAIM

    def _claim(self, now: int) -> RunPreStepHooks:
        messages, splice = self.inbox.claim_next_step()
        if splice is not None:
            self._append(SPLICE_TYPE, splice, now)
        if self._step == 0:
            turn_messages, splice = self.inbox.claim_next_turn()
            if splice is not None:
                self._append(SPLICE_TYPE, splice, now)
            messages += turn_messages
        self.phase = Phase.HOOKS
        return RunPreStepHooks(self._turn, self._step + 1, tuple(messages))

    def hooks_done(self, decision: HookDecision, now: int) -> None:
        """The pre-step hooks' verdict: open the step, or close the turn."""
        self._expect(Phase.HOOKS, "hooks_done")
        if self._step == 0 and (decision.rejected or not decision.messages):
            self._end_turn({"kind": "blocked"}, now)
            return
        self._check_messages(decision.messages)  # a hook's bad rewrite: before any append
        if decision.rejected:
            reason: dict[str, JsonValue] = {"kind": "hook"}
            if decision.reason is not None:
                reason["reason"] = decision.reason
            self._end_turn({"kind": "aborted", "reason": reason}, now)
            return
        self._step += 1
        self._had_tool_calls = False
        self._append("step/start", {"turn": self._turn, "step": self._step}, now)
        for message in decision.messages:
            self._append("user/message", message, now, surface=True)
        if self._config.config is None:
            self._close_step(now)
            self._end_turn(error_reason("no provider/model configured for this session; "
                                         "send a configure command first", NO_MODEL), now)
            return
        self._reset_attempt(1)
        if self._routing:  # the header names the route: logged once it is chosen
            self.phase = Phase.ROUTE
            return
        self._log_header_if_changed(now)
        self.phase = Phase.CALL

    def _check_messages(self, messages: Iterable[JsonValue]) -> None:
        """Validate user messages as the ``user/message`` events they will become."""
        for offset, message in enumerate(messages, start=1):
            validate_event(Event("user/message", self.log.next_seq + offset, 0, message,
                                 APPEND), mode=self.log.mode)

    def _log_header_if_changed(self, now: int) -> None:
        due = self._config.header_due()
        if due is None:
            return
        header, reason = due
        config = self._config.request_config()
        self._append("request/header", {"header": header, "reason": reason}, now)
        self._append("request/context", {"provider": config.provider, "model": config.model},
                     now)

    # -- ends -----------------------------------------------------------------------------

    def _close_step(self, now: int) -> None:
        self._append("step/end", {"turn": self._turn, "step": self._step}, now)
        self._boundary = True
        self.phase = Phase.AFTER_STEP

    def _end_turn(self, reason: dict[str, JsonValue], now: int) -> None:
        self._append("turn/end", {"turn": self._turn, "reason": reason}, now)
        self._boundary = True
        self._abort_reason = None
        self.phase = Phase.IDLE

    def _after_step(self, now: int) -> Effect:
        if self._end_reason is not None:
            self._end_turn(self._end_reason, now)
        elif self._had_tool_calls or self.inbox.steered:
            self.phase = Phase.CLAIM
        else:
            self._end_turn({"kind": "completed"}, now)
        return self.next_effect(now)

    @property
    def cancel_requested(self) -> bool:
        """An abort is pending: no tool may start; the next effect closes the turn."""
        return self._abort_reason is not None

    def abort(self, kind: str = "user") -> None:
        """Ask to abort the open turn (``turn/end aborted`` with ``reason.kind == kind``).

        ``user`` is a cancel command; ``disposed`` a driver that gives the session up. No-op
        when no turn is open.
        """
        if kind == "disposed" and self._gate.waiting is not None:
            return  # the wait is in the log: the next owner goes on waiting
        if self.phase is not Phase.IDLE and self._abort_reason is None:
            self._abort_reason = {"kind": kind}

    def _abort(self, reason: dict[str, JsonValue], now: int) -> Effect:
        """Close the turn for a user cancel, from whatever point it had reached."""
        if self.phase is Phase.STREAMING:
            self._append_assistant(self._acc.partial_content(), now, interrupted=True)
            self._tools = ToolRound(calls_of(self._acc.partial_content()))
        if self._gate.waiting is not None:  # dsh: an aborted ask resolves "cancelled"
            call_id, denial = self._gate.close("cancel", now, self._gate_append)
            self._tools.outcomes[call_id] = denial
        if self.phase in (Phase.STREAMING, Phase.TOOLS):
            self._close_unanswered(TOOL_CANCELED, _CANCELED_TEXT, now)
        if self.phase in (Phase.ROUTE, Phase.ROUTING, Phase.CALL, Phase.STREAMING,
                          Phase.RETRY_WAIT, Phase.TOOLS):
            self._close_step(now)
        self._end_turn({"kind": "aborted", "reason": reason}, now)
        self._boundary = False
        return StepBoundary()

    def _expect(self, phase: Phase, what: str) -> None:
        if self.phase is not phase:
            raise TurnError(f"{what} called in phase {self.phase.name}, expected {phase.name}")

