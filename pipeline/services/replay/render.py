"""A readable view of session events, for ``tail`` (live) and ``replay --transcript``.

Turns start at the margin, steps are indented by two, what happens in a step by four.
Streaming text is assembled from ``assistant/chunk`` deltas as they arrive (written without a
newline until the block ends); the ``assistant/message`` that follows is then not repeated.
Colours are ANSI escapes, only when asked for (a terminal); piped output is plain text.
With several sessions interleaved, every line starts with the session id.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from pipeline.core.events import Event, dumps_json

_COLOURS: Final = {"turn": "1;34", "step": "36", "user": "1;32", "assistant": "0",
                   "reasoning": "2", "tool": "33", "error": "31", "other": "2"}
_MAX_TOOL_TEXT: Final = 300


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif block.get("type") in ("tool-result", "tool_result"):
            parts.append(_text_of(block.get("content")))
    return "".join(parts)


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _clip(text: str, limit: int = _MAX_TOOL_TEXT) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(slots=True)
class _Stream:
    session_id: str
    kind: str  # "text" or "reasoning"


class Renderer:
    """Feed events in order; each call returns the text to write (may lack a final newline)."""

    def __init__(self, *, colour: bool = False, show_session: bool = False) -> None:
        self.colour = colour
        self.show_session = show_session
        self._open: _Stream | None = None
        self._streamed_steps: set[tuple[str, Any, Any]] = set()

    def _paint(self, kind: str, text: str) -> str:
        return f"\x1b[{_COLOURS[kind]}m{text}\x1b[0m" if self.colour else text

    def _line(self, session_id: str, indent: int, kind: str, text: str) -> str:
        prefix = f"[{session_id}] " if self.show_session else ""
        return self._close() + prefix + " " * indent + self._paint(kind, text) + "\n"

    def _close(self) -> str:
        if self._open is None:
            return ""
        self._open = None
        return "\n"

    def feed(self, session_id: str, event: Event) -> str:
        data = event.data if isinstance(event.data, dict) else {}
        handler = getattr(self, "_on_" + event.type.replace("/", "_").replace("-", "_"), None)
        if handler is not None:
            return str(handler(session_id, data))
        return self._line(session_id, 4, "other", f"· {event.type}")

    def finish(self) -> str:
        return self._close()

    def _on_turn_start(self, sid: str, data: dict[str, Any]) -> str:
        return self._line(sid, 0, "turn", f"▶ turn {data.get('turn')}")

    def _on_turn_end(self, sid: str, data: dict[str, Any]) -> str:
        reason = _obj(data.get("reason"))
        kind = str(reason.get("kind"))
        error = _obj(reason.get("error"))
        detail = f": {error.get('code')} {error.get('message')}" if error else ""
        colour = "error" if kind in ("error", "interrupted") else "turn"
        return self._line(sid, 0, colour, f"■ turn {data.get('turn')} {kind}{detail}")

    def _on_step_start(self, sid: str, data: dict[str, Any]) -> str:
        return self._line(sid, 2, "step", f"step {data.get('step')}")

    def _on_step_end(self, sid: str, data: dict[str, Any]) -> str:
        return self._close()

    def _on_user_message(self, sid: str, data: dict[str, Any]) -> str:
        return self._line(sid, 4, "user", f"user: {_text_of(data.get('content'))}")

    def _on_assistant_chunk(self, sid: str, data: dict[str, Any]) -> str:
        chunk = _obj(data.get("chunk"))
        kind = {"text-delta": "text", "reasoning-delta": "reasoning"}.get(str(chunk.get("type")))
        if kind is None or not isinstance(chunk.get("text"), str):
            return ""
        self._streamed_steps.add((sid, data.get("turn"), data.get("step")))
        out = ""
        if self._open is None or self._open != _Stream(sid, kind):
            out = self._close() + (f"[{sid}] " if self.show_session else "") + "    " + \
                self._paint(kind if kind == "reasoning" else "assistant",
                            "thinking: " if kind == "reasoning" else "assistant: ")
            self._open = _Stream(sid, kind)
        return out + self._paint("reasoning" if kind == "reasoning" else "assistant",
                                 chunk["text"])

    def _on_assistant_message(self, sid: str, data: dict[str, Any]) -> str:
        if (sid, data.get("turn"), data.get("step")) in self._streamed_steps:
            return self._close()
        message = _obj(data.get("message"))
        text = _text_of(message.get("content"))
        return self._line(sid, 4, "assistant", f"assistant: {text}") if text else ""

    def _on_tool_call(self, sid: str, data: dict[str, Any]) -> str:
        return self._line(sid, 4, "tool", f"→ {data.get('name')}("
                          f"{_clip(str(data.get('arguments', '')))})")

    def _on_tool_result(self, sid: str, data: dict[str, Any]) -> str:
        message = _obj(data.get("message"))
        content = message.get("content")
        failed = bool(data.get("error")) or any(
            isinstance(b, dict) and b.get("isError") for b in (content or [])
            if isinstance(content, list))
        return self._line(sid, 4, "error" if failed else "tool",
                          f"← {_clip(_text_of(content))}")

    def _on_request_header(self, sid: str, data: dict[str, Any]) -> str:
        header = _obj(data.get("header"))
        config = _obj(header.get("config"))
        return self._line(sid, 4, "other",
                          f"· request {config.get('provider')}/{config.get('model')}")


def transcript(session_id: str, events: list[Event]) -> Iterator[str]:
    """A whole session as plain text (what ``replay --session ID --transcript`` prints)."""
    renderer = Renderer()
    for event in events:
        yield renderer.feed(session_id, event)
    yield renderer.finish()


__all__ = ["Renderer", "dumps_json", "transcript"]
