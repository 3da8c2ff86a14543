"""dsh messages -> OpenAI ``/chat/completions`` request bodies (pure, no I/O).

One function, :func:`to_openai_messages`, decides how every dsh message shape reaches an
OpenAI-compatible API:

- user text blocks -> one ``user`` message (a plain string unless images are present);
- ``tool-result`` blocks of a user-role message -> one ``role: tool`` message each, in order,
  before any remaining user blocks of that message;
- assistant ``text`` -> ``content``, ``tool-call`` -> ``tool_calls``, ``reasoning`` ->
  ``reasoning_content`` according to the reasoning pass-back rule:
  ``"none"`` drops it (plain OpenAI), ``"tool-turns"`` keeps it on every assistant message
  between two user messages where the model called tools (DeepSeek thinking mode requires
  this and ignores it elsewhere), ``"all"`` keeps it everywhere;
- the simplified shapes of the source documents (``tool_use{id,name,input}`` blocks and
  ``role: "tool"`` messages) are accepted too.

Unknown block types are carried in the log but are not model-visible here: they are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

from pipeline.core.errors import ProviderError
from pipeline.core.model import ModelRequest

JsonObj: TypeAlias = dict[str, Any]
ReasoningPassback: TypeAlias = Literal["none", "tool-turns", "all"]

IMAGE_PLACEHOLDER: Final = "[image]"


@dataclass(frozen=True, slots=True)
class ChatDialect:
    """What differs between OpenAI-compatible servers for the same request."""

    name: str
    reasoning_passback: ReasoningPassback
    thinking_switch: bool  # DeepSeek: {"thinking": {"type": "enabled"|"disabled"}}


OPENAI_DIALECT: Final = ChatDialect("openai-compatible", "none", thinking_switch=False)
DEEPSEEK_DIALECT: Final = ChatDialect("deepseek", "tool-turns", thinking_switch=True)


def _bad(message: str) -> ProviderError:
    return ProviderError(f"cannot convert the request: {message}", code="BAD_REQUEST")


def _text_of(blocks: Any) -> str:
    """The text a tool result or plain message shows (a string is taken as is)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for block in blocks if isinstance(blocks, list) else []:
        if isinstance(block, Mapping) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, Mapping) and block.get("type") == "image":
            parts.append(IMAGE_PLACEHOLDER)
    return "\n".join(parts)


def _image_part(block: Mapping[str, Any]) -> JsonObj:
    attachment = block.get("attachment")
    if isinstance(attachment, Mapping):
        url = attachment.get("url")
        data = attachment.get("data")
        media = attachment.get("mediaType") or attachment.get("mimeType") or "image/png"
        if isinstance(url, str):
            return {"type": "image_url", "image_url": {"url": url}}
        if isinstance(data, str):
            return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    return {"type": "text", "text": IMAGE_PLACEHOLDER}


def _user_messages(msg: Mapping[str, Any], where: str) -> list[JsonObj]:
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}: user content must be a list of blocks")
    out: list[JsonObj] = []
    parts: list[JsonObj] = []
    for block in content:
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "tool-result":
            call_id = block.get("toolCallId")
            if not isinstance(call_id, str):
                raise _bad(f"{where}: tool-result block without a toolCallId")
            out.append({"role": "tool", "tool_call_id": call_id,
                         "content": _text_of(block.get("content", []))})
        elif kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image":
            parts.append(_image_part(block))
    if parts:
        if all(p["type"] == "text" for p in parts):
            out.append({"role": "user", "content": "\n".join(p["text"] for p in parts)})
        else:
            out.append({"role": "user", "content": parts})
    return out


def _tool_call(block: Mapping[str, Any], where: str) -> JsonObj:
    call_id, name = block.get("id"), block.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise _bad(f"{where}: tool call without a string id and name")
    if block.get("type") == "tool_use":  # source-document shape: parsed input
        arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
    else:
        arguments = block.get("arguments", "")
        if not isinstance(arguments, str):
            raise _bad(f"{where}: tool-call arguments must be the raw string")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant_message(msg: Mapping[str, Any], where: str) -> JsonObj:
    content = msg.get("content")
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where}: assistant content must be a list of blocks")
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[JsonObj] = []
    for block in content:
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "reasoning":
            reasoning.append(str(block.get("text", "")))
        elif kind in ("tool-call", "tool_use"):
            calls.append(_tool_call(block, where))
    out: JsonObj = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


def _legacy_tool_message(msg: Mapping[str, Any], pending: list[str], where: str) -> JsonObj:
    call_id = msg.get("toolCallId")
    if not isinstance(call_id, str):
        if not pending:
            raise _bad(f"{where}: tool message answers no pending tool call")
        call_id = pending[0]
    if call_id in pending:
        pending.remove(call_id)
    return {"role": "tool", "tool_call_id": call_id, "content": _text_of(msg.get("content"))}


def _convert_one(msg: Any, index: int, pending: list[str]) -> list[JsonObj]:
    where = f"message {index}"
    if not isinstance(msg, Mapping):
        raise _bad(f"{where}: a message must be an object")
    role = msg.get("role")
    if role == "user":
        converted = _user_messages(msg, where)
        answered = {m["tool_call_id"] for m in converted if m["role"] == "tool"}
        pending[:] = [c for c in pending if c not in answered]
        return converted
    if role == "assistant":
        converted_one = _assistant_message(msg, where)
        pending[:] = [c["id"] for c in converted_one.get("tool_calls", [])]
        return [converted_one]
    if role == "tool":
        return [_legacy_tool_message(msg, pending, where)]
    raise _bad(f"{where}: unknown role {role!r}")


def _apply_reasoning_passback(messages: list[JsonObj], rule: ReasoningPassback) -> None:
    if rule == "all":
        return
    stretch: list[JsonObj] = []  # assistant messages since the last user message
    for msg in [*messages, {"role": "user"}]:  # a sentinel closes the last stretch
        if msg["role"] == "assistant":
            stretch.append(msg)
        elif msg["role"] == "user":
            keep = rule == "tool-turns" and any("tool_calls" in m for m in stretch)
            if not keep:
                for assistant in stretch:
                    assistant.pop("reasoning_content", None)
            stretch = []


def to_openai_messages(messages: Sequence[Any], *, system: str | None = None,
                       reasoning_passback: ReasoningPassback = "none") -> list[JsonObj]:
    """The OpenAI chat ``messages`` for a list of dsh derived messages."""
    out: list[JsonObj] = []
    if system is not None:
        out.append({"role": "system", "content": system})
    pending: list[str] = []
    for index, msg in enumerate(messages):
        out.extend(_convert_one(msg, index, pending))
    _apply_reasoning_passback(out, reasoning_passback)
    return out


def to_openai_tools(tools: Iterable[Any]) -> list[JsonObj]:
    """Tool definitions as OpenAI ``tools`` (OpenAI-shaped definitions pass through)."""
    out: list[JsonObj] = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise _bad(f"tool {index}: a tool definition must be an object")
        if tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
            out.append(dict(tool))
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tool {index}: missing 'name'")
        params = (tool.get("parameters") or tool.get("inputSchema") or tool.get("input_schema")
                  or {"type": "object", "properties": {}})
        function: JsonObj = {"name": name}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = params
        out.append({"type": "function", "function": function})
    return out


def build_chat_body(request: ModelRequest, dialect: ChatDialect) -> JsonObj:
    """The JSON body of a streaming ``POST /chat/completions`` for ``request``."""
    body: JsonObj = {
        "model": request.model,
        "messages": to_openai_messages(request.messages, system=request.system,
                                       reasoning_passback=dialect.reasoning_passback),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.tools:
        body["tools"] = to_openai_tools(request.tools)
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    effort = request.reasoning_effort
    if dialect.thinking_switch and effort is not None:
        body["thinking"] = {"type": "disabled" if effort == "none" else "enabled"}
    if effort is not None and effort != "none":
        body["reasoning_effort"] = effort
    return body
