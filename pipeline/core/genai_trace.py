"""OpenTelemetry GenAI spans of dsh turns: a pure function of the turn's events.

Follows the GenAI semantic conventions v1.41.0 (Development status; the instrumentations'
opt-in for it is ``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental``):

- a turn is one ``invoke_agent`` span (INTERNAL), the root of the turn's trace, or the child
  of the caller's span when the turn's records carry a W3C ``traceparent``;
- each step is one ``chat {model}`` span (CLIENT) under it: ``gen_ai.request.model``,
  ``gen_ai.provider.name``, ``gen_ai.usage.input_tokens`` (cached input included, as the
  conventions count it; see :mod:`pipeline.core.usage`), ``gen_ai.usage.output_tokens``,
  ``gen_ai.response.finish_reasons``;
- each tool call is one ``execute_tool {name}`` span (INTERNAL) under the turn, a sibling of
  the chat span that asked for it: ``gen_ai.tool.name``, ``gen_ai.tool.call.id``;
- every span has ``gen_ai.conversation.id`` = the session id; a failed operation has
  status ERROR and ``error.type`` (the provider error's code, the tool error's code,
  ``interrupted`` for a turn closed by crash repair); retries (``llm/retry``,
  ``llm/retry-started``) and cancels are span events;
- a tool call's wait for a person's approval is two span events of its ``execute_tool`` span:
  ``dsh.approval.asked`` (``dsh.approval.id``, ``dsh.approval.reason``) when it began and
  ``dsh.approval.decided`` (``dsh.approval.outcome``, ``dsh.approval.wait_ms``) when it ended.

Ids are derived from (session, turn, step, call id) with SHA-256, so exporting the same log
again (a replay, a restart) gives the same trace and span ids: a receiver that keys spans by
id sees the same spans, never a second trace. With a caller's ``traceparent`` the trace id
is the caller's and the parent is the caller's span.

The finish reasons come from the log without the chunks (which a consumer skips unread):
``tool_calls`` when the message calls tools, ``length`` for the last step of a
``max-tokens`` turn, ``cancelled`` for an interrupted message, else ``stop``. Message content
(``gen_ai.input.messages``, ``gen_ai.output.messages``, ``gen_ai.tool.call.arguments``,
``gen_ai.tool.call.result``) is added only when asked for (``with_content``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from pipeline.core.errors import EventError
from pipeline.core.events import Event, JsonValue
from pipeline.core.lifecycle import declared_number
from pipeline.core.usage import UNKNOWN, TokenCounts, header_model, message_model

SEMCONV_VERSION: Final = "1.41.0"
SEMCONV_SCHEMA_URL: Final = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
SEMCONV_OPT_IN: Final = "gen_ai_latest_experimental"
AGENT_SPAN: Final = "invoke_agent"
# The event types a span is built from; every other type (the many chunks) is skipped unread.
SPAN_EVENT_TYPES: Final = frozenset({
    "turn/start", "turn/end", "step/start", "step/end", "user/message", "assistant/message",
    "tool/call", "tool/result", "request/header", "llm/retry", "llm/retry-started",
    "approval/asked", "approval/decided"})
AttrValue = str | int | float | bool | tuple[str, ...]
_TRACEPARENT: Final = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A caller's W3C trace context (``traceparent`` header, version 00)."""

    trace_id: bytes  # 16 bytes
    span_id: bytes   # 8 bytes
    flags: int

    @classmethod
    def parse(cls, text: str | None) -> TraceParent | None:
        """The context of a valid header; None for a missing or invalid one (W3C: an invalid
        traceparent is ignored, the work starts a trace of its own)."""
        found = _TRACEPARENT.match(text.strip()) if text else None
        if found is None or found[1] == "ff":
            return None
        trace, span = bytes.fromhex(found[2]), bytes.fromhex(found[3])
        if not any(trace) or not any(span):
            return None
        return cls(trace, span, int(found[4], 16))

    def header(self) -> str:
        return f"00-{self.trace_id.hex()}-{self.span_id.hex()}-{self.flags:02x}"


@dataclass(frozen=True, slots=True)
class SpanEvent:
    name: str
    time_ms: int
    attributes: Mapping[str, AttrValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Span:
    """One span, ready to encode (times in epoch ms; ``end_ms`` never before ``start_ms``)."""

    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes  # b"" for a root span
    name: str
    kind: str  # "INTERNAL" or "CLIENT"
    start_ms: int
    end_ms: int
    attributes: Mapping[str, AttrValue]
    events: tuple[SpanEvent, ...] = ()
    error: str | None = None  # the status message of a failed operation; None: unset

    @property
    def operation(self) -> str:
        return str(self.attributes.get("gen_ai.operation.name", ""))


def derive_id(size: int, *parts: str | int) -> bytes:
    """A deterministic non-zero id of ``size`` bytes for ``parts``."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    out = digest[:size]
    return out if any(out) else b"\x01" + out[1:]


def trace_id_of(session_id: str, turn: int) -> bytes:
    return derive_id(16, "dsh-trace", session_id, turn)


def span_id_of(session_id: str, turn: int, step: int | None = None,
               call_id: str | None = None) -> bytes:
    parts: list[str | int] = ["dsh-span", session_id, turn]
    if step is not None:
        parts.append(step)
    if call_id is not None:
        parts += ["call", call_id]
    return derive_id(8, *parts)


@dataclass(slots=True)
class ToolState:
    call_id: str
    step: int
    name: str = UNKNOWN
    start_ms: int | None = None
    end_ms: int | None = None
    arguments: str | None = None
    result: JsonValue = None
    error: str | None = None
    events: list[SpanEvent] = field(default_factory=list)  # the approval wait


@dataclass(slots=True)
class StepState:
    number: int
    start_ms: int
    model: tuple[str, str] | None
    end_ms: int | None = None
    message: Mapping[str, JsonValue] | None = None
    message_ms: int | None = None
    usage: TokenCounts | None = None
    interrupted: bool = False
    inputs: list[JsonValue] = field(default_factory=list)
    events: list[SpanEvent] = field(default_factory=list)


@dataclass(slots=True)
class TurnBuilder:
    """The events of one open turn, folded as they come; :meth:`spans` once it ended."""

    session_id: str
    turn: int
    start_ms: int
    model: tuple[str, str] | None  # the session's request header model when the turn began
    parent: TraceParent | None = None
    steps: dict[int, StepState] = field(default_factory=dict)
    tools: dict[str, ToolState] = field(default_factory=dict)
    asked: dict[str, tuple[str, int]] = field(default_factory=dict)  # approval id -> call, ms
    end: Mapping[str, JsonValue] | None = None
    end_ms: int = 0

    def add(self, event: Event, traceparent: str | None = None) -> None:
        """Fold one event of this turn (after its ``turn/start``)."""
        if self.parent is None and traceparent:
            self.parent = TraceParent.parse(traceparent)
        data = event.data if isinstance(event.data, Mapping) else {}
        handler = _HANDLERS.get(event.type)
        if handler is not None:
            handler(self, event, data)
        elif (found := header_model(event)) is not None:
            self.model = found  # dsh logs a step's header after its step/start
            if self.steps and (step := self.steps[max(self.steps)]).message is None:
                step.model = found

    def _step(self, data: Mapping[str, JsonValue], time_ms: int) -> StepState:
        number = data.get("step")
        number = number if isinstance(number, int) else max(self.steps, default=1)
        step = self.steps.get(number)
        if step is None:
            step = self.steps[number] = StepState(number, time_ms, self.model)
        return step

    def _tool(self, call_id: str, step: int) -> ToolState:
        tool = self.tools.get(call_id)
        if tool is None:
            tool = self.tools[call_id] = ToolState(call_id, step)
        return tool

    @property
    def ended(self) -> bool:
        return self.end is not None


def _on_step_start(turn: TurnBuilder, event: Event, data: Mapping[str, JsonValue]) -> None:
    step = turn._step(data, event.time)
    step.start_ms, step.model = event.time, turn.model


def _on_step_end(turn: TurnBuilder, event: Event, data: Mapping[str, JsonValue]) -> None:
    turn._step(data, event.time).end_ms = event.time


def _on_user_message(turn: TurnBuilder, event: Event, data: Mapping[str, JsonValue]) -> None:
    if turn.steps:
        turn.steps[max(turn.steps)].inputs.append(dict(data))


def _on_assistant(turn: TurnBuilder, event: Event, data: Mapping[str, JsonValue]) -> None:
    step = turn._step(data, event.time)
    message = data.get("message")
    step.message = message if isinstance(message, Mapping) else {}
    step.message_ms = event.time
    step.interrupted = data.get("interrupted") is True
    step.model = message_model(event) or step.model
    usage = data.get("usage")
    if usage is not None:
        try:
            step.usage = TokenCounts.from_dsh(usage, seq=event.seq)
        except EventError:
            step.usage = None  # a malformed usage is left out, not guessed


def _on_tool_call(turn: TurnBuilder, event: Event, data: Mapping[str, JsonValue]) -> None:
    call_id = data.get("callId")
    if not isinstance(call_id, str):
        return
    step = turn._step(data, event.time)
    tool = turn._tool(call_id, step.number)
    name, arguments = data.get("name"), data.get("arguments")
    tool.name = name if isinstance(name, str) else UNKNOWN
    tool.start_ms = event.time
    tool.arguments = arguments if isinstance(arguments, str) else None


def _on_tool_result(turn: TurnBuilder, event: Event, data: Mapping[str, JsonValue]) -> None:
    message = data.get("message")
    blocks = message.get("content") if isinstance(message, Mapping) else None
    block = blocks[0] if isinstance(blocks, list) and blocks else None
    if not isinstance(block, Mapping) or not isinstance(block.get("toolCallId"), str):
        return
    if _names_another_turn(turn, data):
        return  # a pruning rewrite of an older turn's result: no tool ran in this turn
    step = turn._step(data, event.time)
    tool = turn._tool(str(block["toolCallId"]), step.number)
    if tool.name == UNKNOWN:
        tool.name = _tool_name_of(step, tool.call_id)
    tool.end_ms = event.time
    tool.result = block.get("content")
    error = data.get("error")
    if isinstance(error, Mapping):
        tool.error = str(error.get("code") or error.get("name") or "tool_error")
    elif block.get("isError") is True:
        tool.error = "tool_error"


def _names_another_turn(turn: TurnBuilder, data: Mapping[str, JsonValue]) -> bool:
    number = declared_number(data, "turn")
    return number is not None and number != turn.turn


def _tool_name_of(step: StepState, call_id: str) -> str:
    """The name the model gave a call (a call never started has no ``tool/call``)."""
    content = step.message.get("content") if step.message is not None else None
    for block in content if isinstance(content, list) else ():
        if (isinstance(block, Mapping) and block.get("type") == "tool-call"
                and block.get("id") == call_id and isinstance(block.get("name"), str)):
            return str(block["name"])
    return UNKNOWN


def _on_retry(turn: TurnBuilder, event: Event, data: Mapping[str, JsonValue]) -> None:
    step = turn._step(data, event.time)
    attributes: dict[str, AttrValue] = {}
    for key, name in (("attempt", "dsh.retry.attempt"), ("delayMs", "dsh.retry.delay_ms")):
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            attributes[name] = value
    error = data.get("error")
    if isinstance(error, Mapping) and isinstance(error.get("code"), str):
        attributes["error.type"] = str(error["code"])
    name = "dsh.llm.retry" if event.type == "llm/retry" else "dsh.llm.retry_started"
    step.events.append(SpanEvent(name, event.time, attributes))


def _on_approval_asked(turn: TurnBuilder, event: Event, data: Mapping[str, JsonValue]
                       ) -> None:
    approval_id, call_id = data.get("id"), data.get("callId")
    tool = turn.tools.get(call_id) if isinstance(call_id, str) else None
    if tool is None or not isinstance(approval_id, str):
        return  # an ask about no recorded call (dsh's own asks may have none): no span
    turn.asked[approval_id] = (tool.call_id, event.time)
    attributes: dict[str, AttrValue] = {"dsh.approval.id": approval_id}
    if isinstance(data.get("reason"), str):
        attributes["dsh.approval.reason"] = str(data["reason"])
    tool.events.append(SpanEvent("dsh.approval.asked", event.time, attributes))


def _on_approval_decided(turn: TurnBuilder, event: Event, data: Mapping[str, JsonValue]
                         ) -> None:
    asked = turn.asked.pop(str(data.get("id")), None)
    if asked is None:
        return
    outcome = data.get("outcome")
    turn.tools[asked[0]].events.append(SpanEvent("dsh.approval.decided", event.time, {
        "dsh.approval.outcome": outcome if isinstance(outcome, str) else UNKNOWN,
        "dsh.approval.wait_ms": event.time - asked[1]}))


def _on_turn_end(turn: TurnBuilder, event: Event, data: Mapping[str, JsonValue]) -> None:
    reason = data.get("reason")
    turn.end = reason if isinstance(reason, Mapping) else {"kind": UNKNOWN}
    turn.end_ms = event.time


_HANDLERS: Final = {
    "step/start": _on_step_start, "step/end": _on_step_end, "user/message": _on_user_message,
    "assistant/message": _on_assistant, "tool/call": _on_tool_call,
    "tool/result": _on_tool_result, "llm/retry": _on_retry, "llm/retry-started": _on_retry,
    "turn/end": _on_turn_end, "approval/asked": _on_approval_asked,
    "approval/decided": _on_approval_decided,
}


def content_json(value: JsonValue | Sequence[JsonValue]) -> str:
    """Content attributes are JSON strings (the conventions' recording of structured values)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
