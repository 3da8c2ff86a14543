"""``dsh-pipeline derive``: show a session file's turns and the messages the model sees.

``derive FILE`` prints a readable view of the log (turn and step boundaries, chunk types, tool
calls, other events) and then the derived messages the model sees, like the example of the
spec. ``derive --json FILE`` prints exactly one JSON array: the derived messages, each as it
stands in its event.

It reads files in ingest mode (the spec's simplified shapes accepted) unless ``--strict``;
``-`` reads stdin. It does not read the ``DSH_*`` settings. (``validate``, which checks
files: :mod:`pipeline.cli.cmd_validate`.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Final, TextIO

from pipeline.cli.common import binary_input, input_name, log_mode, printable
from pipeline.codec.sessionfile import SessionFile, load_session
from pipeline.core.events import Event, JsonValue, Replace
from pipeline.core.log import SessionLog
from pipeline.core.lossless import dumps_json_safe
from pipeline.settings import Settings

PREVIEW: Final = 160


def register(subparsers: Any) -> None:
    derive = subparsers.add_parser(
        "derive", help="show a session file's turns and the messages the model sees",
        description="Read a dsh session file (.jsonl or .jsonl.zstd) and print its turn/step "
                    "structure followed by the derived messages (what the model sees).")
    derive.add_argument("file", metavar="FILE",
                        help="session file (.jsonl or .jsonl.zstd; - for stdin)")
    derive.add_argument("--json", action="store_true",
                        help="print only the derived messages, as one JSON array")
    derive.add_argument("--strict", action="store_true",
                        help="validate with dsh's strict message shapes (what the driver "
                             "writes) instead of ingest mode")
    derive.add_argument("--at-seq", type=int, metavar="SEQ", default=None,
                        help="derive the messages as of just after event SEQ")
    derive.set_defaults(func=run_derive, uses_settings=False)


def run_derive(args: argparse.Namespace, settings: Settings, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    with binary_input(args.file) as handle:
        session_file, log = load_session(input_name(args.file), mode=log_mode(args),
                                         handle=handle)
    for warning in session_file.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    messages = log.messages() if args.at_seq is None else log.messages_at(args.at_seq)
    if args.json:
        out.write(dumps_json_safe(list(messages)) + "\n")
        return 0
    for line in render_view(session_file, log, messages):
        out.write(printable(line) + "\n")
    return 0


# --- the readable view -----------------------------------------------------------------------

def render_view(session_file: SessionFile, log: SessionLog,
                messages: Sequence[JsonValue]) -> Iterator[str]:
    state = log.turn
    yield (f"session {session_file.session_id or '(no header)'}: {len(log.events)} events, "
           f"{state.last_turn} turn(s){', turn open' if state.in_turn else ''}")
    yield from _render_events(log.events)
    yield ""
    yield f"Derived messages visible to the model ({len(messages)}):"
    for message in messages:
        yield "  " + render_message(message)


def _render_events(events: Sequence[Event]) -> Iterator[str]:
    run_type: str | None = None
    run_length = 0
    for event in events:
        chunk_type = _chunk_type(event)
        if chunk_type is not None and chunk_type == run_type:
            run_length += 1
            continue
        if run_type is not None:
            yield _chunk_line(run_type, run_length)
        run_type, run_length = chunk_type, 1
        if chunk_type is None:
            line = _event_line(event)
            if line is not None:
                yield line
    if run_type is not None:
        yield _chunk_line(run_type, run_length)


def _chunk_type(event: Event) -> str | None:
    if event.type != "assistant/chunk" or not isinstance(event.data, dict):
        return None
    chunk = event.data.get("chunk")
    kind = chunk.get("type") if isinstance(chunk, dict) else None
    return kind if isinstance(kind, str) else "?"


def _chunk_line(kind: str, count: int) -> str:
    return f"    chunk: {kind}" + (f" x{count}" if count > 1 else "")


def _event_line(event: Event) -> str | None:
    data: dict[str, Any] = event.data if isinstance(event.data, dict) else {}
    kind = event.type
    if kind == "turn/start":
        return f"[turn/start] turn={data.get('turn')}"
    if kind == "turn/end":
        return f"[turn/end]   turn={data.get('turn')} reason={_json(data.get('reason'))}"
    if kind in ("step/start", "step/end"):
        pad = " " if kind == "step/start" else "   "
        return f"  [{kind}]{pad}turn={data.get('turn')} step={data.get('step')}"
    if kind == "tool/call":
        return f"    tool/call: {data.get('name')} args={_clip(str(data.get('arguments')))}"
    if kind in ("user/message", "assistant/message", "tool/result"):
        op = event.surface_op
        where = ("replace " + f"{op.start}..{op.end}" if isinstance(op, Replace)
                 else "append" if op else "off-surface")
        extra = " (interrupted)" if data.get("interrupted") else ""
        return f"    {kind} seq {event.seq} ({where}){extra}"
    return f"    ({kind})"


def render_message(message: JsonValue) -> str:
    if not isinstance(message, dict):
        return _clip(_json(message))
    role = message.get("role", "?")
    content = message.get("content")
    if role == "tool":
        return f"[tool] {message.get('toolName', '?')}: {_clip(_content_text(content))}"
    return f"[{role}] {_clip(_content_text(content))}"


def _content_text(content: JsonValue) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return _json(content)
    return " | ".join(_block_text(block) for block in content)


def _block_text(block: JsonValue) -> str:
    if not isinstance(block, dict):
        return _json(block)
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text"))
    if kind == "reasoning":
        return f"(reasoning) {block.get('text')}"
    if kind == "tool-call":
        return f"tool-call {block.get('name')}({block.get('arguments')})"
    if kind == "tool_use":
        return f"tool_use {block.get('name')}({_json(block.get('input'))})"
    if kind == "tool-result":
        error = " error" if block.get("isError") else ""
        return f"tool-result {block.get('toolCallId')}{error}: " + _content_text(
            block.get("content"))
    return _json(block)


def _json(value: JsonValue) -> str:
    return dumps_json_safe(value)


def _clip(text: str) -> str:
    flat = text.replace("\n", "\\n")
    return flat if len(flat) <= PREVIEW else flat[:PREVIEW - 1] + "…"
