"""The model call of the turn machine: the request, its stream, and a failure's retry.

A mixin of :class:`pipeline.core.turn_machine.TurnMachine` (kept apart for size, not for
reuse), as :mod:`pipeline.core.turn_machine_tools` is. In the CALL phase the machine asks
:class:`CallModel` with the only request the log allows (:meth:`StreamPhase.expected_request`);
each chunk is logged as ``assistant/chunk`` as it comes, the end of the stream logs the
``assistant/message`` (its sources: that attempt's chunk seqs) and moves on to the tools, the
step's end or the turn's; a failure is retried in the step after a :class:`Sleep`
(``llm/retry``, ``llm/retry-started``), handed to a fallback route
(:mod:`pipeline.core.turn_machine_routes`), or ends the turn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Final

from pipeline.core.errors import InvariantViolation, ProviderError
from pipeline.core.events import JsonValue
from pipeline.core.log import SessionLog
from pipeline.core.model import (
    SUCCESS_FINISH_KINDS,
    ModelRequest,
    RetryPolicy,
    StreamAccumulator,
    error_finish,
    failure_of,
)
from pipeline.core.provider_routes import Route
from pipeline.core.turn_config import ConfigState
from pipeline.core.turn_effects import TOOL_NOT_STARTED, CallModel
from pipeline.core.turn_machine_tools import Phase
from pipeline.core.turn_requests import request_diff, stream_error
from pipeline.core.turn_tools import ToolRound, calls_of

_TRUNCATED_TEXT: Final = ("The tool call was not run: the model's output was cut off at the "
                          "token limit.")


class StreamPhase:
    """The machine's model-call methods; the attributes and methods below are the machine's
    (or its other mixins')."""

    log: SessionLog
    phase: Phase
    _config: ConfigState
    _retry: RetryPolicy
    _new_id: Callable[[], str]
    _turn: int
    _step: int
    _attempt: int
    _acc: StreamAccumulator
    _chunk_seqs: list[int]
    _replay_state: JsonValue
    _retry_delay: int | None
    _asked: tuple[str, str]  # provider, model: who the attempt's request asks
    _tools: ToolRound
    _had_tool_calls: bool
    _end_reason: dict[str, JsonValue] | None

    def _append(self, type_: str, data: JsonValue, now: int, *, surface: bool = False,
                sources: Iterable[int] | None = None, ignorable: bool | None = None) -> int:
        raise NotImplementedError

    def _expect(self, phase: Phase, what: str) -> None:
        raise NotImplementedError

    def _reset_attempt(self, attempt: int) -> None:
        raise NotImplementedError

    def _close_step(self, now: int) -> None:
        raise NotImplementedError

    def _end_turn(self, reason: dict[str, JsonValue], now: int) -> None:
        raise NotImplementedError

    def _close_unanswered(self, error: Mapping[str, str], text: str, now: int) -> None:
        raise NotImplementedError

    def _fail_over(self, error: ProviderError, fallback: Route, now: int) -> None:
        raise NotImplementedError

    @property
    def _route_attempt(self) -> int:
        raise NotImplementedError

    def expected_request(self) -> ModelRequest:
        """The only request the log allows now: derived messages + last logged header."""
        config = self._config.request_config()  # what the last logged header states
        return ModelRequest(
            provider=config.provider, model=config.model,
            messages=tuple(self.log.messages()), system=config.system, tools=config.tools,
            reasoning_effort=config.reasoning_effort, max_tokens=config.max_tokens)

    def check_request(self, request: ModelRequest) -> None:
        """Refuse a request that differs from what the log derives (a bug: fail loudly)."""
        expected = self.expected_request()
        if request == expected:
            return
        raise InvariantViolation(
            f"session {self.log.session_id!r} turn {self._turn} step {self._step}: the model "
            f"request differs from the log in {', '.join(request_diff(expected, request))}")

    def _call_model(self) -> CallModel:
        request = self.expected_request()
        # the answer's source names who was asked, whatever a configure changes meanwhile
        self._asked = (request.provider, request.model)
        self.phase = Phase.STREAMING
        return CallModel(request, self._attempt)

    def chunk(self, chunk: Mapping[str, JsonValue], now: int) -> None:
        """One stream chunk, logged as ``assistant/chunk`` as it comes."""
        self._expect(Phase.STREAMING, "chunk")
        self._chunk_seqs.append(self._append(
            "assistant/chunk", {"turn": self._turn, "step": self._step, "chunk": dict(chunk)},
            now))
        self._acc.add(chunk)
        if chunk.get("type") == "finish" and "replayState" in chunk:
            self._replay_state = chunk["replayState"]

    def stream_ended(self, now: int) -> None:
        """The stream ended normally: log the message, then tools, the end, or a new step."""
        self._expect(Phase.STREAMING, "stream_ended")
        kind = self._acc.finish_kind
        if kind not in SUCCESS_FINISH_KINDS:
            self._failed(stream_error(self._acc.finish), now, log_finish=kind != "error")
            return
        content = self._acc.content()
        self._append_assistant(content, now, usage=self._acc.usage)
        self._tools = ToolRound(calls_of(content))
        self._had_tool_calls = bool(self._tools.calls)
        if kind == "max-tokens":
            self._end_reason = {"kind": "max-tokens"}  # sticky: never continues by itself
            self._close_unanswered(TOOL_NOT_STARTED, _TRUNCATED_TEXT, now)
            self._close_step(now)
        elif self._tools.calls:
            self.phase = Phase.TOOLS
        else:
            self._close_step(now)

    def _append_assistant(self, content: list[JsonValue], now: int, *,
                          usage: JsonValue = None, interrupted: bool = False) -> None:
        source: dict[str, JsonValue] = {"kind": "model", "provider": self._asked[0],
                                        "model": self._asked[1]}
        if self._replay_state is not None:  # the provider's opaque state for the next call
            source["replayState"] = self._replay_state
        message = {"id": self._new_id(), "role": "assistant", "content": content,
                   "source": source}
        data: dict[str, JsonValue] = {"turn": self._turn, "step": self._step,
                                      "message": message}
        if usage is not None:
            data["usage"] = usage
        if interrupted:
            data["interrupted"] = True
        self._append("assistant/message", data, now, surface=True, sources=self._chunk_seqs)

    def stream_failed(self, error: ProviderError, now: int, *, jitter: float = 0.5,
                      fallback: Route | None = None) -> None:
        """The provider call failed (possibly mid-stream): retry in this step, or end;
        or call ``fallback`` at once (the caller left the route: ``leaves_route``)."""
        self._expect(Phase.STREAMING, "stream_failed")
        self._failed(error, now, log_finish=self._acc.finish_kind != "error", jitter=jitter,
                     fallback=fallback)

    def _failed(self, error: ProviderError, now: int, *, log_finish: bool,
                jitter: float = 0.5, fallback: Route | None = None) -> None:
        if log_finish:
            self.chunk(error_finish(error), now)
        if fallback is not None:
            self._fail_over(error, fallback, now)
            return
        if self._retry.should_retry(self._route_attempt, error):
            delay = self._retry.delay_ms(self._route_attempt, error, jitter)
            self._append("llm/retry", {
                "turn": self._turn, "step": self._step, "attempt": self._attempt,
                "delayMs": delay, "error": failure_of(error)}, now)
            self._retry_delay = delay
            self.phase = Phase.RETRY_WAIT
            return
        self._close_step(now)
        self._end_turn({"kind": "error", "error": failure_of(error)}, now)

    def sleep_done(self, now: int) -> None:
        """The backoff is over: log the new attempt and call the model again."""
        self._expect(Phase.RETRY_WAIT, "sleep_done")
        self._reset_attempt(self._attempt + 1)
        self._append("llm/retry-started", {"turn": self._turn, "step": self._step,
                                           "attempt": self._attempt}, now)
        self.phase = Phase.CALL
