"""The spans of an ended turn (:func:`build_spans`) and the per-session fold that finds the
turns as events arrive (:class:`SessionTraces`). Shapes and ids: :mod:`genai_trace`.

A turn is exported once it ends: ``turn/end`` closes it, including the ``interrupted`` end
crash repair appends, whose time is the repair's. Events of a session before its first
``turn/start`` seen (a stream joined mid-turn) build nothing: a turn is exported whole or not
at all (:attr:`SessionTraces.skipped_partial` counts the turns so left out, also one whose
``turn/end`` never came before the next ``turn/start``). :attr:`SessionTraces.open_since`
names the first event of the open turn, which a consumer must read again after a restart
(it commits no offset past it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from pipeline.core.events import Event, JsonValue
from pipeline.core.genai_trace import (
    AGENT_SPAN,
    AttrValue,
    Span,
    SpanEvent,
    StepState,
    ToolState,
    TurnBuilder,
    content_json,
    span_id_of,
    trace_id_of,
)
from pipeline.core.usage import UNKNOWN, TokenCounts, header_model

_FINISH_OF_END: Final = {"max-tokens": "length"}
_USAGE_ATTRIBUTES: Final = ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
                            "gen_ai.usage.cache_read.input_tokens",
                            "gen_ai.usage.cache_creation.input_tokens",
                            "dsh.usage.reasoning_tokens")


def build_spans(turn: TurnBuilder, *, with_content: bool = False) -> list[Span]:
    """The ``invoke_agent`` span of an ended turn, then its chat and tool spans in order."""
    trace = turn.parent.trace_id if turn.parent is not None else trace_id_of(
        turn.session_id, turn.turn)
    root_id = span_id_of(turn.session_id, turn.turn)
    children: list[Span] = []
    last_step = max(turn.steps, default=None)
    for number in sorted(turn.steps):
        step = turn.steps[number]
        children.append(_chat_span(turn, step, trace, root_id, number == last_step,
                                   with_content))
        children += [_tool_span(turn, tool, trace, root_id, with_content)
                     for tool in turn.tools.values() if tool.step == number]
    return [_agent_span(turn, trace, root_id, children), *children]


def _common(turn: TurnBuilder, operation: str) -> dict[str, AttrValue]:
    return {"gen_ai.operation.name": operation, "gen_ai.conversation.id": turn.session_id,
            "dsh.turn": turn.turn}


def _model_attributes(model: tuple[str, str] | None) -> dict[str, AttrValue]:
    provider, name = model if model is not None else (UNKNOWN, UNKNOWN)
    return {"gen_ai.provider.name": provider, "gen_ai.request.model": name}


def _usage_attributes(counts: TokenCounts) -> dict[str, AttrValue]:
    every = counts.otel_attributes()
    return {name: every[name] for name in _USAGE_ATTRIBUTES}


def _agent_span(turn: TurnBuilder, trace: bytes, root_id: bytes,
                children: list[Span]) -> Span:
    attributes = _common(turn, AGENT_SPAN)
    attributes["session.id"] = turn.session_id  # how Langfuse groups traces into sessions
    first = turn.steps[min(turn.steps)].model if turn.steps else turn.model
    if first is not None:
        attributes.update(_model_attributes(first))
    total = sum((s.usage for s in turn.steps.values() if s.usage is not None), TokenCounts())
    attributes.update(_usage_attributes(total))
    end = turn.end or {}
    kind = str(end.get("kind", UNKNOWN))
    attributes["dsh.turn.end_reason"] = kind
    events: list[SpanEvent] = []
    error = None
    if kind == "aborted":
        why = end.get("reason")
        cause = str(why.get("kind", UNKNOWN)) if isinstance(why, Mapping) else UNKNOWN
        events.append(SpanEvent("dsh.turn.cancelled", turn.end_ms, {"dsh.abort.kind": cause}))
    elif kind in ("error", "interrupted", "blocked"):
        error = _error_type(end) if kind == "error" else kind
        attributes["error.type"] = error
    parent = turn.parent.span_id if turn.parent is not None else b""
    end_ms = max([turn.end_ms, turn.start_ms, *(c.end_ms for c in children)])
    return Span(trace, root_id, parent, AGENT_SPAN, "INTERNAL", turn.start_ms, end_ms,
                attributes, tuple(events), error)


def _error_type(reason: Mapping[str, JsonValue]) -> str:
    error = reason.get("error")
    code = error.get("code") if isinstance(error, Mapping) else None
    return code if isinstance(code, str) and code else "error"


def _finish_reason(turn: TurnBuilder, step: StepState, last: bool) -> str:
    content = step.message.get("content") if step.message is not None else None
    if step.interrupted:
        return "cancelled"
    if any(isinstance(b, Mapping) and b.get("type") == "tool-call"
           for b in (content if isinstance(content, list) else ())):
        return "tool_calls"
    if last and turn.end is not None:
        return _FINISH_OF_END.get(str(turn.end.get("kind")), "stop")
    return "stop"


def _chat_span(turn: TurnBuilder, step: StepState, trace: bytes, root_id: bytes, last: bool,
               with_content: bool) -> Span:
    model = _model_attributes(step.model)
    attributes = {**_common(turn, "chat"), **model, "dsh.step": step.number}
    error = None
    if step.message is not None:
        attributes["gen_ai.response.finish_reasons"] = (_finish_reason(turn, step, last),)
        if step.usage is not None:
            attributes.update(_usage_attributes(step.usage))
    elif last and turn.end is not None and turn.end.get("kind") == "error":
        error = _error_type(turn.end)
    elif last and turn.end is not None and turn.end.get("kind") == "interrupted":
        error = "interrupted"
    if error is not None:
        attributes["error.type"] = error
    events = list(step.events)
    if step.interrupted:
        events.append(SpanEvent("dsh.llm.cancelled", step.message_ms or step.start_ms))
    if with_content:
        _chat_content(attributes, step)
    end = step.message_ms if step.message_ms is not None else (step.end_ms or turn.end_ms)
    return Span(trace, span_id_of(turn.session_id, turn.turn, step.number), root_id,
                f"chat {model['gen_ai.request.model']}", "CLIENT", step.start_ms,
                max(end, step.start_ms), attributes, tuple(events), error)


def _tool_span(turn: TurnBuilder, tool: ToolState, trace: bytes, root_id: bytes,
               with_content: bool) -> Span:
    attributes = {**_common(turn, "execute_tool"), "gen_ai.tool.name": tool.name,
                  "gen_ai.tool.call.id": tool.call_id, "gen_ai.tool.type": "function",
                  "dsh.step": tool.step}
    if tool.error is not None:
        attributes["error.type"] = tool.error
    if with_content:
        if tool.arguments is not None:
            attributes["gen_ai.tool.call.arguments"] = tool.arguments
        if tool.result is not None:
            attributes["gen_ai.tool.call.result"] = content_json(tool.result)
    start = tool.start_ms if tool.start_ms is not None else (tool.end_ms or turn.end_ms)
    end = tool.end_ms if tool.end_ms is not None else turn.end_ms
    return Span(trace, span_id_of(turn.session_id, turn.turn, tool.step, tool.call_id),
                root_id, f"execute_tool {tool.name}", "INTERNAL", start, max(start, end),
                attributes, tuple(tool.events), tool.error)


def _chat_content(attributes: dict[str, AttrValue], step: StepState) -> None:
    """The messages that entered the step and the model's answer, as the conventions' parts."""
    if step.inputs:
        attributes["gen_ai.input.messages"] = content_json(
            [_message_parts(m) for m in step.inputs])
    if step.message is not None:
        answer = _message_parts(step.message)
        attributes["gen_ai.output.messages"] = content_json([answer])


def _message_parts(message: Mapping[str, JsonValue]) -> JsonValue:
    content = message.get("content")
    parts: list[JsonValue] = []
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if kind in ("text", "reasoning"):
            parts.append({"type": kind, "content": block.get("text")})
        elif kind == "tool-call":
            parts.append({"type": "tool_call", "id": block.get("id"),
                          "name": block.get("name"), "arguments": block.get("arguments")})
        elif kind == "tool-result":
            parts.append({"type": "tool_call_response", "id": block.get("toolCallId"),
                          "response": block.get("content")})
        else:
            parts.append({"type": str(kind)})
    return {"role": message.get("role", UNKNOWN), "parts": parts}


@dataclass(slots=True)
class SessionTraces:
    """One session's fold: the model of its last request header and its open turn.

    :meth:`add` returns the ended :class:`TurnBuilder` when an event closes a turn.
    Events are expected in seq order; one at or below the last seq seen is a redelivery and
    ignored.
    """

    session_id: str
    model: tuple[str, str] | None = None
    open: TurnBuilder | None = None
    open_since: int | None = None  # the position (e.g. offset) of the open turn's start
    last_seq: int = -1
    skipped_partial: int = 0

    def add(self, event: Event, position: int, traceparent: str | None = None
            ) -> TurnBuilder | None:
        if event.seq <= self.last_seq:
            return None
        self.last_seq = event.seq
        if (found := header_model(event)) is not None:
            self.model = found
        if event.type == "turn/start":
            if self.open is not None:  # its turn/end never came: it cannot be exported whole
                self.skipped_partial += 1
            turn = event.data.get("turn") if isinstance(event.data, Mapping) else None
            self.open = TurnBuilder(self.session_id, turn if isinstance(turn, int) else 0,
                                    event.time, self.model)
            self.open_since = position
        elif self.open is None:
            if event.type == "turn/end":
                self.skipped_partial += 1
            return None
        self.open.add(event, traceparent)
        if self.open.ended:
            ended, self.open, self.open_since = self.open, None, None
            return ended
        return None
