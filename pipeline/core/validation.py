"""Event-local validation: every rule that one event can be checked against on its own.

Rules that need the log (seq contiguity, replace targets on the live surface, what a
``tool/result`` replacement may change) live with the state they need: :mod:`pipeline.core.log`
and :mod:`pipeline.core.surface`. Every failure is an :class:`EventError` naming the seq, the
type and the rule.

Two modes. ``strict`` is what the driver writes: dsh's own message shapes (``id``, ``role``,
``source``; a ``tool/result`` holds exactly one ``tool-result`` block whose ``toolCallId`` is
``source.callId``). ``ingest`` also accepts the simplified shapes of the spec's example
(``fixtures/seed-example.jsonl``: no ids or sources, ``tool_use`` blocks, a ``tool``-role result)
and a surface event without ``surfaceOp`` (it then stays off the surface); every envelope,
lossless-JSON and surface rule still holds.

The rules, by the name errors carry (``[rule: ...]``):

envelope (:func:`pipeline.core.events.event_from_json`): ``envelope-object``,
``envelope-type``, ``envelope-keys`` (only type/seq/time/data/surfaceOp/sourceEventSeqs/
ignorable), ``envelope-seq``, ``envelope-time`` (an integer, within +-2^53), ``envelope-data``,
``envelope-ignorable`` (absent or true), ``surface-op-shape``, ``source-seqs-shape``;
log: ``seq-contiguous`` (no gap, no repeat);
types and data: ``unknown-type`` (refused unless ignorable), ``lossless-json``,
``data-object`` (core types), ``turn-number``, ``step-number``, ``turn-end-reason``,
``chunk-shape``, ``tool-call-shape``, ``request-header-shape`` (strict);
surface metadata: ``surface-op-placement``, ``source-seqs-placement`` (surface types only),
``surface-op-required`` (strict), ``source-seqs-empty`` (``[]`` only on assistant/message),
``source-seqs-unique``, ``source-seqs-earlier``, ``replace-range`` (earlier seqs);
surface fold (:mod:`pipeline.core.surface`): ``replace-target-live``, ``replace-range-order``,
``replace-sources`` (sourceEventSeqs name every shadowed node), ``tool-result-replace-one``,
``tool-result-replace-target``, ``tool-result-replace-content-only``;
messages (:mod:`pipeline.core.messages`): ``message-shape``, ``message-id``, ``message-role``,
``message-source``, ``message-content``, ``content-block``, ``assistant-message-shape``,
``tool-result-source``, ``tool-result-block``, ``tool-result-call-id``, ``tool-result-error``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from pipeline.core import messages
from pipeline.core.events import Event, JsonValue, Replace
from pipeline.core.lossless import find_lossless_violation
from pipeline.core.rules import MODES, Mode, fail, is_int, need_int, need_str
from pipeline.core.types import BOUNDARY_TYPES, CORE_TYPES, SURFACE_TYPES, is_known

__all__ = ["MODES", "Mode", "projected_message", "validate_event"]


def validate_event(event: Event, *, mode: Mode = "strict") -> None:
    """Check every rule of ``event`` that does not depend on the rest of the log."""
    if event.ignorable is False:
        fail(event, "'ignorable' is either absent or true", "envelope-ignorable")
    if event.time < -(2**53) or event.time > 2**53:
        fail(event, f"time {event.time} is outside the safe integer range", "envelope-time")
    problem = find_lossless_violation(event.data, allow_lone_surrogates=mode != "strict")
    if problem is not None:
        fail(event, f"data is not lossless JSON: {problem}", "lossless-json")
    if not is_known(event.type):
        if event.ignorable:
            return  # carried opaquely: its surface metadata never touches the surface
        fail(event, "unknown event type (an unknown type must be marked ignorable: true)",
             "unknown-type")
    _check_surface_metadata(event, mode)
    if event.type in CORE_TYPES:
        if not isinstance(event.data, dict):
            fail(event, "data of a core event must be a JSON object", "data-object")
        checker = _DATA_CHECKERS.get(event.type)
        if checker is not None:
            checker(event, event.data, mode)


def _check_surface_metadata(event: Event, mode: Mode) -> None:
    if event.type not in SURFACE_TYPES:
        if event.surface_op is not None:
            fail(event, "only user/message, assistant/message and tool/result carry surfaceOp",
                 "surface-op-placement")
        if event.source_event_seqs is not None:
            fail(event, "only surface events carry sourceEventSeqs", "source-seqs-placement")
        return
    if event.surface_op is None and mode == "strict":
        fail(event, "a surface event must carry surfaceOp", "surface-op-required")
    if isinstance(event.surface_op, Replace):
        op = event.surface_op
        if not (0 <= op.start < event.seq and 0 <= op.end < event.seq):
            fail(event, f"replace range {op.start}..{op.end} must name earlier events",
                 "replace-range")
    _check_sources(event)


def _check_sources(event: Event) -> None:
    sources = event.source_event_seqs
    if sources is None:
        return
    if not sources and event.type != "assistant/message":
        fail(event, "sourceEventSeqs may be empty only on assistant/message",
             "source-seqs-empty")
    if len(set(sources)) != len(sources):
        fail(event, "sourceEventSeqs must not repeat a seq", "source-seqs-unique")
    for source in sources:
        if source < 0 or source >= event.seq:
            fail(event, f"sourceEventSeqs entry {source} is not an earlier seq",
                 "source-seqs-earlier")


# --- data shapes -----------------------------------------------------------------------------

def _check_boundary(event: Event, data: dict[str, Any], mode: Mode) -> None:
    need_int(event, data, "turn", "turn-number")
    if event.type.startswith("step/"):
        need_int(event, data, "step", "step-number")
    if event.type == "turn/end":
        reason = data.get("reason")
        if not isinstance(reason, dict) or not isinstance(reason.get("kind"), str):
            fail(event, "data.reason must be an object with a string kind", "turn-end-reason")


_INDEXED_CHUNKS: Final = frozenset(
    {"text-delta", "reasoning-delta", "tool-call-delta", "block-start", "block-end"})


def _check_chunk(event: Event, data: dict[str, Any], mode: Mode) -> None:
    need_int(event, data, "turn", "turn-number")
    need_int(event, data, "step", "step-number")
    chunk = data.get("chunk")
    if not isinstance(chunk, dict) or not isinstance(chunk.get("type"), str):
        fail(event, "data.chunk must be an object with a string type", "chunk-shape")
    if mode != "strict":
        return
    kind = chunk["type"]
    if kind in ("text-delta", "reasoning-delta"):
        need_str(event, chunk, "text", "data.chunk", "chunk-shape")
    elif kind == "tool-call-delta":
        need_str(event, chunk, "id", "data.chunk", "chunk-shape")
        need_str(event, chunk, "argumentsDelta", "data.chunk", "chunk-shape")
        if "name" in chunk:
            need_str(event, chunk, "name", "data.chunk", "chunk-shape")
    if kind in _INDEXED_CHUNKS and not is_int(chunk.get("index")):
        fail(event, "data.chunk.index must be an integer", "chunk-shape")


def _check_tool_call(event: Event, data: dict[str, Any], mode: Mode) -> None:
    need_int(event, data, "turn", "turn-number")
    need_int(event, data, "step", "step-number")
    for key in ("callId", "name", "arguments"):
        need_str(event, data, key, "data", "tool-call-shape")


def _check_request_header(event: Event, data: dict[str, Any], mode: Mode) -> None:
    if mode == "strict" and not isinstance(data.get("header"), dict):
        fail(event, "data.header must be an object", "request-header-shape")


_DATA_CHECKERS: Final[dict[str, Callable[[Event, dict[str, Any], Mode], None]]] = {
    "turn/start": _check_boundary,
    "turn/end": _check_boundary,
    "step/start": _check_boundary,
    "step/end": _check_boundary,
    "assistant/chunk": _check_chunk,
    "tool/call": _check_tool_call,
    "request/header": _check_request_header,
    "user/message": messages.check_user_message,
    "assistant/message": messages.check_assistant_message,
    "tool/result": messages.check_tool_result,
}
assert _DATA_CHECKERS.keys() >= BOUNDARY_TYPES


def projected_message(event: Event) -> JsonValue | None:
    """What a surface node projects to in the derived messages (None: nothing).

    ``user/message`` -> its data; ``assistant/message`` -> ``data.message`` unless its content
    is empty; ``tool/result`` -> ``data.message``. The object is the one in the event, shared.
    """
    if event.type == "user/message":
        return event.data
    if event.type == "assistant/message":
        message = event.data.get("message") if isinstance(event.data, dict) else None
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if content is None or (isinstance(content, list | str) and len(content) == 0):
            return None
        return message
    if event.type == "tool/result":
        return event.data.get("message") if isinstance(event.data, dict) else None
    return None

