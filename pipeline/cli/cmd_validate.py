"""``dsh-pipeline validate``: check session files against the session-log rules.

``validate FILE...`` prints one line per problem, ``FILE:LINE: seq N, type T: message
[rule: R]``, and exits 1 if there is any, or if a torn tail (an unterminated last line, a cut
last zstd frame) had to be dropped, unless ``--allow-torn-tail`` accepts that (the dropped
bytes are reported either way).

It reads files in ingest mode (the spec's simplified shapes accepted) unless ``--strict``;
``-`` reads stdin. It does not read the ``DSH_*`` settings. (``derive``, which shows a file:
:mod:`pipeline.cli.cmd_derive`.)
"""

from __future__ import annotations

import argparse
import sys
from typing import IO, Any, Final, TextIO

from pipeline.cli.common import binary_input, input_name, log_mode, printable
from pipeline.codec.sessionfile import FileProblem, SessionFile, scan_session_file
from pipeline.core.errors import EventError, SessionFileError
from pipeline.core.events import Event
from pipeline.core.log import Mode, SessionLog
from pipeline.settings import Settings

MAX_PROBLEMS_SHOWN: Final = 100  # per file
REFUSED_PLACEHOLDER: Final = "x-dsh-pipeline/refused"


def register(subparsers: Any) -> None:
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


def run_validate(args: argparse.Namespace, settings: Settings,
                 out: TextIO | None = None) -> int:
    out = out or sys.stdout
    failed = False
    for path in args.files:
        try:
            with binary_input(path) as handle:
                problems, session_file = validate_file(input_name(path), log_mode(args),
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
