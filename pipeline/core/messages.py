"""Shapes of the three surface events' messages, strict (dsh) and simplified (spec example).

Strict is dsh's shape: ``{id, role, content:[blocks], source:{kind,...}}``; a tool result is a
user-role message with exactly one ``tool-result`` block whose ``toolCallId`` equals
``source.callId`` (``source.kind == "tool"``). Block and source kinds are open: only the
known ones have their fields checked, unknown ones are carried as they are.

Ingest mode accepts a message that passes the strict check, or else one of the simplified
shapes of the spec's example: ``{role:"user", content}``, ``{role:"assistant", content}`` and
``{role:"tool", content, ...}``; when neither fits, the strict error is reported (it is the
more precise one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from pipeline.core.errors import EventError
from pipeline.core.events import Event
from pipeline.core.rules import Mode, fail, is_int, need_int, need_str

_BLOCK_STRING_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "text": ("text",),
    "reasoning": ("text",),
    "tool-call": ("id", "name", "arguments"),
}


def _check_blocks(event: Event, content: Any, where: str, depth: int = 0) -> None:
    if not isinstance(content, list):
        fail(event, f"{where}.content must be an array of blocks", "message-content")
    for index, block in enumerate(content):
        at = f"{where}.content[{index}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            fail(event, f"{at} must be an object with a string type", "content-block")
        for key in _BLOCK_STRING_FIELDS.get(block["type"], ()):
            need_str(event, block, key, at, "content-block")
        if block["type"] == "tool-result" and depth == 0:  # nested results: carried as is
            need_str(event, block, "toolCallId", at, "content-block")
            _check_blocks(event, block.get("content"), at, depth + 1)
            if "isError" in block and not isinstance(block["isError"], bool):
                fail(event, f"{at}.isError must be a boolean", "content-block")


def _check_strict_message(event: Event, message: Any, role: str, where: str) -> None:
    if not isinstance(message, dict):
        fail(event, f"{where} must be an object", "message-shape")
    if not isinstance(message.get("id"), str) or not message["id"]:
        fail(event, f"{where}.id must be a non-empty string", "message-id")
    if message.get("role") != role:
        fail(event, f"{where}.role must be {role!r}", "message-role")
    source = message.get("source")
    if not isinstance(source, dict) or not isinstance(source.get("kind"), str):
        fail(event, f"{where}.source must be an object with a string kind", "message-source")
    _check_blocks(event, message.get("content"), where)


def _check_simplified(event: Event, message: Any, role: str, where: str) -> None:
    if not isinstance(message, dict) or message.get("role") != role:
        raise EventError("", rule="simplified")
    content = message.get("content")
    if role != "tool" and not isinstance(content, list | str):
        raise EventError("", rule="simplified")
    if role == "tool" and "content" not in message:
        raise EventError("", rule="simplified")


def _strict_or_simplified(event: Event, strict: Callable[[], None],
                          message: Any, roles: tuple[str, ...], where: str) -> None:
    """Ingest mode: the strict shape, or else a simplified one (the strict error if neither)."""
    try:
        strict()
    except EventError as strict_error:
        for role in roles:
            try:
                _check_simplified(event, message, role, where)
                return
            except EventError:
                continue
        raise strict_error from None


def check_user_message(event: Event, data: dict[str, Any], mode: Mode) -> None:
    if mode == "strict":  # what the driver writes: no fallback, and no closure to build
        _check_strict_message(event, data, "user", "data")
        return
    _strict_or_simplified(
        event, lambda: _check_strict_message(event, data, "user", "data"),
        data, ("user",), "data")


def check_assistant_message(event: Event, data: dict[str, Any], mode: Mode) -> None:
    need_int(event, data, "turn", "turn-number")
    need_int(event, data, "step", "step-number")
    message = data.get("message")
    if mode == "strict":
        _check_strict_message(event, message, "assistant", "data.message")
    else:
        _strict_or_simplified(
            event, lambda: _check_strict_message(event, message, "assistant", "data.message"),
            message, ("assistant",), "data.message")
    if "interrupted" in data and not isinstance(data["interrupted"], bool):
        fail(event, "data.interrupted must be a boolean", "assistant-message-shape")
    if "usage" in data and not isinstance(data["usage"], dict):
        fail(event, "data.usage must be an object", "assistant-message-shape")


def check_tool_result(event: Event, data: dict[str, Any], mode: Mode) -> None:
    need_int(event, data, "turn", "turn-number")
    need_int(event, data, "step", "step-number")
    message = data.get("message")
    if mode == "strict":
        _check_strict_tool_result(event, data, message)
        return
    _strict_or_simplified(
        event, lambda: _check_strict_tool_result(event, data, message),
        message, ("tool",), "data.message")


def _check_strict_tool_result(event: Event, data: dict[str, Any], message: Any) -> None:
    where = "data.message"
    _check_strict_message(event, message, "user", where)
    source = message["source"]
    if source["kind"] != "tool" or not isinstance(source.get("callId"), str):
        fail(event, f"{where}.source must be {{kind:\"tool\", callId}}", "tool-result-source")
    content = message["content"]
    if len(content) != 1 or content[0]["type"] != "tool-result":
        fail(event, f"{where}.content must be exactly one tool-result block",
             "tool-result-block")
    if content[0]["toolCallId"] != source["callId"]:
        fail(event, f"{where}.content[0].toolCallId {content[0]['toolCallId']!r} differs from "
             f"source.callId {source['callId']!r}", "tool-result-call-id")
    error = data.get("error")
    if error is not None:
        if not isinstance(error, dict):
            fail(event, "data.error must be an object {name, code}", "tool-result-error")
        need_str(event, error, "name", "data.error", "tool-result-error")
        need_str(event, error, "code", "data.error", "tool-result-error")
        if content[0].get("isError") is not True:
            fail(event, "data.error requires content[0].isError to be true",
                 "tool-result-error")
    if "error" in data and error is None:
        fail(event, "data.error must be an object {name, code}", "tool-result-error")


__all__ = ["check_assistant_message", "check_tool_result", "check_user_message", "is_int"]
