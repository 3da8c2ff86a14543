"""The TOOLS phase of the turn machine: tool calls, their results and approval waits.

A mixin of :class:`pipeline.core.turn_machine.TurnMachine` (kept apart for size, not for
reuse): calls start (``tool/call``), an approval rule may make one wait
(:mod:`pipeline.core.turn_approvals`), and results enter the log in model order
(:mod:`pipeline.core.turn_tools`). :class:`Phase` is the machine's phase.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import Enum, auto

from pipeline.core.errors import TurnError
from pipeline.core.events import JsonValue
from pipeline.core.log import SessionLog
from pipeline.core.turn_approvals import RUN, WAIT, ApprovalGate, resume_wait
from pipeline.core.turn_effects import AwaitApproval, Effect, RunTools, ToolOutcome
from pipeline.core.turn_tools import DueResult, ToolRound, tool_result_data


class Phase(Enum):
    IDLE = auto()        # no turn open
    CLAIM = auto()       # turn open, at a step boundary: claim and run hooks next
    HOOKS = auto()       # waiting for hooks_done
    ROUTE = auto()       # step open: the call's route is to be chosen (ChooseRoute)
    ROUTING = auto()     # waiting for route_chosen
    CALL = auto()        # step open: a model call is due
    STREAMING = auto()   # waiting for chunks and the end of the stream
    RETRY_WAIT = auto()  # a retry is due after Sleep
    TOOLS = auto()       # waiting for tool starts/outcomes
    AFTER_STEP = auto()  # step closed: decide another step or the end


class ToolsPhase:
    """The machine's tool-call methods; the attributes and methods below are the machine's."""

    log: SessionLog
    phase: Phase
    _turn: int
    _step: int
    _tools: ToolRound
    _gate: ApprovalGate
    _had_tool_calls: bool
    _boundary: bool
    _new_id: Callable[[], str]

    def _append(self, type_: str, data: JsonValue, now: int, *, surface: bool = False,
                sources: Iterable[int] | None = None, ignorable: bool | None = None) -> int:
        raise NotImplementedError

    def _expect(self, phase: Phase, what: str) -> None:
        raise NotImplementedError

    def _close_step(self, now: int) -> None:
        raise NotImplementedError

    def next_effect(self, now: int) -> Effect:
        raise NotImplementedError

    @property
    def cancel_requested(self) -> bool:
        raise NotImplementedError

    def _gate_append(self, type_: str, data: JsonValue, now: int, ignorable: bool) -> int:
        return self._append(type_, data, now, ignorable=ignorable or None)

    def _resume_wait(self) -> bool:
        """A rebuilt turn that waits for approval goes on waiting (it is not repaired)."""
        resumed = resume_wait(self.log, self._gate.waiting)
        if resumed is None:
            return False
        self._turn, self._step, self._tools = resumed.turn, resumed.step, resumed.tools
        self._had_tool_calls, self.phase = True, Phase.TOOLS
        return True

    def _tools_effect(self, now: int) -> Effect:
        tools, waiting = self._tools, self._gate.waiting
        if waiting is not None:
            return AwaitApproval(waiting.call_id, self._gate.deadline)
        if not tools.dispatched:
            tools.dispatched = True
            return RunTools(tuple(tools.pending()))
        if not tools.answered:
            raise TurnError(f"next_effect called with {len(tools.calls) - tools.logged} tool "
                            "calls unanswered")
        self._close_step(now)
        return self.next_effect(now)

    def tool_started(self, call_id: str, now: int) -> bool:
        """A call starts: log its ``tool/call`` (refused once a cancel is pending). False:
        it must not run now (it waits for approval, or was denied): start nothing more, ask
        :meth:`next_effect` (which re-dispatches the calls still to run)."""
        self._expect(Phase.TOOLS, "tool_started")
        if self.cancel_requested:
            raise TurnError(f"tool call {call_id!r} must not start: the turn is being canceled")
        if call_id in self._tools.approved:  # recorded before its wait: not a second time
            self._tools.approved.discard(call_id)
            return True
        call = self._tools.start(call_id)
        self._tools.started[call_id] = self._append("tool/call", {
            "turn": self._turn, "step": self._step, "callId": call.call_id, "name": call.name,
            "arguments": call.arguments}, now)
        answer = self._gate.ask(call, self._new_id, now, self._gate_append)
        if answer == RUN:
            return True
        self._tools.dispatched = False
        if answer != WAIT:
            assert isinstance(answer, ToolOutcome)
            self._append_results(self._tools.finish(call_id, answer), now)
        return False

    @property
    def approval_deadline(self) -> int | None:
        """When the call waiting for approval times out (epoch ms); None: no wait or no
        timeout."""
        return self._gate.deadline

    @property
    def waiting_for(self) -> str | None:
        """The id of the tool call waiting for approval, or None."""
        waiting = self._gate.waiting
        return None if waiting is None else waiting.call_id

    def needs_approval(self, tool_name: str) -> bool:
        """Calls of ``tool_name`` wait for a person (the runner starts them alone)."""
        return self._gate.needs_approval(tool_name)

    def expire_approval(self, now: int) -> bool:
        """Deny the waiting call if its approval timed out; True if it did."""
        deadline = self._gate.deadline
        if deadline is None or now < deadline:
            return False
        self._decided(*self._gate.close("timeout", now, self._gate_append), now)
        return True

    def _decided(self, call_id: str, denial: ToolOutcome | None, now: int) -> None:
        """After a decision: the call runs (re-dispatched) or gets its denial; the decision
        is made durable first (a boundary), so a redelivered approve cannot run it twice."""
        self._tools.dispatched = False
        if denial is None:
            self._tools.approved.add(call_id)
        else:
            self._append_results(self._tools.finish(call_id, denial), now)
        self._boundary = True

    def tool_finished(self, call_id: str, outcome: ToolOutcome, now: int) -> None:
        """A call's outcome; results are logged in model order as soon as they can be."""
        self._expect(Phase.TOOLS, "tool_finished")
        self._append_results(self._tools.finish(call_id, outcome), now)

    def _append_results(self, results: Iterable[DueResult], now: int) -> None:
        for result in results:
            data = tool_result_data(self._turn, self._step, result, self._new_id())
            self._append("tool/result", data, now, surface=True, sources=result.sources)
            self._tools.logged += 1

    def _close_unanswered(self, error: Mapping[str, str], text: str, now: int) -> None:
        """Answer every call without a result (none may be running) with an error result."""
        self._append_results(self._tools.unanswered(error, text), now)
