"""``dsh-pipeline derive`` and ``dsh-pipeline validate``: look at and check session files.

``derive FILE`` prints a readable view of the log (turn and step boundaries, chunk types, tool
calls, other events) and then the derived messages the model sees, like the example of the
spec. ``derive --json FILE`` prints exactly one JSON array: the derived messages, each as it
stands in its event. ``validate FILE...`` prints one line per problem,
``FILE:LINE: seq N, type T: message [rule: R]``, and exits 1 if there is any, or if a torn
tail (an unterminated last line, a cut last zstd frame) had to be dropped, unless
``--allow-torn-tail`` accepts that (the dropped bytes are reported either way).

Both read files in ingest mode (the spec's simplified shapes accepted) unless ``--strict``;
``-`` reads stdin. Neither reads the ``DSH_*`` settings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from typing import IO, Any, Final, TextIO

from pipeline.cli.common import binary_input, input_name
from pipeline.codec.sessionfile import (
    FileProblem,
    SessionFile,
    load_session,
    scan_session_file,
)
from pipeline.core.errors import EventError, SessionFileError
from pipeline.core.events import Event, JsonValue, Replace
from pipeline.core.log import Mode, SessionLog
from pipeline.core.lossless import dumps_json_safe
from pipeline.settings import Settings

PREVIEW: Final = 160
MAX_PROBLEMS_SHOWN: Final = 100  # per file
REFUSED_PLACEHOLDER: Final = "x-dsh-pipeline/refused"


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

    validate = subparsers.add_parser(
        "validate", help="check session files against the session-log rules",
        description="Check each FILE; print one line per problem "
                    "(FILE:LINE: seq N, type T: message [rule: R]); exit 1 if any, or if a "
                    "torn tail was dropped (unless --allow-torn-tail).")
    validate.add_argument("files", metavar="FILE", nargs="+",
                          help="session files to check (- for stdin)")
    validate.add_argument("--strict", action="store_true",
                          help="require dsh's strict message shapes (what the driver writes)")
    validate.add_argument("--allow-torn-tail", action="store_true",
                          help="accept a file whose torn tail (unterminated last line, cut "
                               "last zstd frame) was dropped, as a crash mid-write leaves it; "
                               "the dropped bytes are still reported")
    validate.set_defaults(func=run_validate, uses_settings=False)


def _mode(args: argparse.Namespace) -> Mode:
    return "strict" if args.strict else "ingest"


def run_derive(args: argparse.Namespace, settings: Settings, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    with binary_input(args.file) as handle:
        session_file, log = load_session(input_name(args.file), mode=_mode(args), handle=handle)
    for warning in session_file.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    messages = log.messages() if args.at_seq is None else log.messages_at(args.at_seq)
    if args.json:
        out.write(dumps_json_safe(list(messages)) + "\n")
        return 0
    for line in render_view(session_file, log, messages):
        out.write(printable(line) + "\n")
    return 0


def run_validate(args: argparse.Namespace, settings: Settings,
                 out: TextIO | None = None) -> int:
    out = out or sys.stdout
    failed = False
    for path in args.files:
        try:
            with binary_input(path) as handle:
                problems, session_file = validate_file(input_name(path), _mode(args),
                                                       handle=handle)
        except SessionFileError as exc:  # cannot be opened: reported, the others checked
            problems, session_file = [FileProblem(path, None, exc)], None
        for problem in problems[:MAX_PROBLEMS_SHOWN]:
            out.write(printable(str(problem)) + "\n")
        if len(problems) > MAX_PROBLEMS_SHOWN:
            out.write(f"{path}: ... and {len(problems) - MAX_PROBLEMS_SHOWN} more problems\n")
        if session_file is None:
            failed = True
            continue
        torn = _torn_tail_note(session_file)
        refused = bool(torn) and not args.allow_torn_tail
        if refused:
            out.write(f"{input_name(path)}: {torn}: data is missing (--allow-torn-tail accepts "
                      "it)\n")
        if problems or refused:
            failed = True
        else:
            accepted = f"; {torn}, accepted" if torn else ""
            out.write(f"{input_name(path)}: valid ({len(session_file.events)} events{accepted})\n")
    return 1 if failed else 0




def _torn_tail_note(session_file: SessionFile) -> str:
    """What was dropped at the end of the file, or "" when nothing was."""
    if not session_file.dropped_bytes:
        return ""
    return f"torn tail of {session_file.dropped_bytes} bytes dropped"


def validate_file(path: str, mode: Mode, *, handle: IO[bytes] | None = None
                  ) -> tuple[list[FileProblem], SessionFile | None]:
    """Every line problem of ``path`` and every event the fold refuses.

    A refused event is replaced by an inert placeholder (an unknown ``ignorable`` event) so
    that the events after it are still checked against the log as accepted so far; a hole
    left by a bad line ends the fold (the events after it cannot be placed).
    """
    try:
        session_file, problems = scan_session_file(path, handle=handle)
    except SessionFileError as exc:  # the file cannot be opened at all
        return [FileProblem(path, None, exc)], None
    log = SessionLog(session_file.session_id or "", mode=mode)
    for event, line in zip(session_file.events, session_file.lines, strict=True):
        if event.seq != log.next_seq:
            break  # a hole already reported as a line problem
        try:
            log.append(event)
        except EventError as exc:
            problems.append(FileProblem(path, line, exc))
            log.append(Event(REFUSED_PLACEHOLDER, event.seq, event.time, None, ignorable=True))
    problems.sort(key=lambda p: p.line or 0)
    return problems, session_file


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


def printable(text: str) -> str:
    """``text`` with lone surrogates (which ingest mode accepts) shown as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _clip(text: str) -> str:
    flat = text.replace("\n", "\\n")
    return flat if len(flat) <= PREVIEW else flat[:PREVIEW - 1] + "…"
