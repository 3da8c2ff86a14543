"""What every ``dsh-pipeline`` command shares: exit codes, stdin/stdout files, the parser
conventions (defaults in help, a description for every command), durations with units,
``--host``/``--port`` and ``--log-level``/``--log-format``.

This module imports only the standard library (and core's errors): every command imports it,
and the commands that work on files must start fast.

Exit codes (docs/cli.md): 0 ok; 1 invalid input or a failed check; 2 usage error (bad
options, arguments or ``DSH_*`` settings); 130 interrupted (Ctrl-C); 141 the reader of stdout
went away (a pipe into ``head``), as for any program killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any, Final

from pipeline.core.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.core.rules import Mode

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130
EXIT_BROKEN_PIPE: Final = 141
EXIT_CODES: Final = (
    (EXIT_OK, "ok"),
    (EXIT_FAILED, "invalid input or a failed check (the reason on stderr)"),
    (EXIT_USAGE, "usage error: bad options or arguments, or a bad DSH_* setting"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C, SIGINT)"),
    (EXIT_BROKEN_PIPE, "the reader of stdout went away (SIGPIPE: piped into `head`, say)"),
)


def exit_code_table() -> str:
    """The exit codes as the Markdown table of docs/cli.md (a test keeps them equal)."""
    rows = [f"| {code} | {meaning} |" for code, meaning in EXIT_CODES]
    return "\n".join(["| code | meaning |", "|---|---|", *rows]) + "\n"

STDIO: Final = "-"  # as a file argument: stdin to read, stdout to write


# --- files ------------------------------------------------------------------------------------

def is_stdio(path: object) -> bool:
    return str(path) == STDIO


def input_name(path: str) -> str:
    """How the input ``path`` is named in messages: ``<stdin>`` for ``-``."""
    return "<stdin>" if is_stdio(path) else path


@contextlib.contextmanager
def binary_input(path: str) -> Iterator[IO[bytes]]:
    """``path`` opened for reading bytes, or stdin for ``-``."""
    if is_stdio(path):
        yield sys.stdin.buffer
        return
    try:
        handle = open(path, "rb")  # noqa: SIM115  (closed below, after the caller's block)
    except OSError as exc:
        from pipeline.core.errors import SessionFileError
        raise SessionFileError(f"{path}: cannot read: {exc.strerror or exc}",
                               path=path) from None
    with handle:
        yield handle


def refuse_overwrite(output: str | None, *inputs: str) -> None:
    """A usage error when ``output`` is one of ``inputs`` (same file, whatever the spelling)."""
    if output is None or is_stdio(output):
        return
    for given in inputs:
        if is_stdio(given):
            continue
        same = os.path.abspath(output) == os.path.abspath(given)
        with contextlib.suppress(OSError):
            same = same or os.path.samefile(output, given)
        if same:
            raise ConfigError(f"refusing to overwrite the input file {given} with the output "
                              "(give another -o)")


def log_mode(args: argparse.Namespace) -> Mode:
    """How a file command validates a session file: ``--strict``, else ingest mode."""
    return "strict" if args.strict else "ingest"


def printable(text: str) -> str:
    """``text`` with lone surrogates (which ingest mode accepts) shown as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# --- progress on stderr ---------------------------------------------------------------------

def progress_line(line: str) -> None:
    """A line of progress on stderr (``export``, ``ship``, ``replay``)."""
    clear = "\r\x1b[K" if sys.stderr.isatty() else ""  # over a live progress line
    print(f"{clear}{line}", file=sys.stderr, flush=True)


class TerminalProgress:
    """One progress line on a terminal's stderr, rewritten in place (``import``, ``ship``)."""

    def __init__(self) -> None:
        self.line = ""

    def __call__(self, line: str) -> None:
        self.line = line
        sys.stderr.write(f"\r\x1b[K{line}")
        sys.stderr.flush()

    def clear(self) -> None:
        sys.stderr.write("\r\x1b[K")

    def done(self) -> None:
        if self.line:
            sys.stderr.write(f"\r\x1b[K{self.line}\n")
            sys.stderr.flush()


# --- the parser convention --------------------------------------------------------------------

class HelpFormatter(argparse.HelpFormatter):
    """Descriptions keep their paragraphs (and indented lines); every option that has a
    default shows it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.strip("\n").split("\n\n"):
            if any(line.startswith(" ") for line in paragraph.splitlines()):
                paragraphs.append(paragraph)  # a literal block: keep it as written
            else:
                paragraphs.append(textwrap.fill(" ".join(paragraph.split()), width,
                                                initial_indent=indent,
                                                subsequent_indent=indent,
                                                break_on_hyphens=False))
        return "\n\n".join(paragraphs)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("%(default)" in text or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings or "(default" in text):
            return text
        return f"{text} (default: %(default)s)"


class SubcommandsAction(argparse._SubParsersAction):  # type: ignore[type-arg]
    """``add_parser`` with the project's formatter, and the help as the description when a
    command gives none: every command has a description in its ``--help``."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if kwargs.get("description") is None and kwargs.get("help"):
            text = str(kwargs["help"])
            kwargs["description"] = text[:1].upper() + text[1:] + "."
        kwargs.setdefault("formatter_class", HelpFormatter)
        parser: argparse.ArgumentParser = super().add_parser(name, **kwargs)
        parser.register("action", "parsers", SubcommandsAction)
        return parser


def new_parser(**kwargs: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter, **kwargs)
    parser.register("action", "parsers", SubcommandsAction)
    return parser


def add_session_argument(parser: argparse.ArgumentParser, *, optional: bool = False,
                         many: bool = False, help: str | None = None) -> None:
    """The session a command works on: always the positional ``SESSION`` (the record key)."""
    nargs = "*" if many else ("?" if optional else None)
    parser.add_argument("session" if not many else "sessions", metavar="SESSION", nargs=nargs,
                        help=help or "session id (the record key)")


# --- durations --------------------------------------------------------------------------------

_DURATION: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``500ms``, ``30s``, ``5m``, ``1h``, ``2d`` -> seconds; a bare number is seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration such as 500ms, 30s, 5m or 1h")
    return float(match.group(1)) * _UNIT_S[match.group(2) or "s"]


def parse_duration_ms(text: str) -> int:
    """A duration (see :func:`parse_duration`) in whole milliseconds."""
    return round(parse_duration(text) * 1000)


def format_duration(seconds: float) -> str:
    """The shortest exact spelling (``25ms``, ``10s``, ``5m``), for defaults in help."""
    ms = round(seconds * 1000)
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def add_duration(parser: argparse.ArgumentParser | Any, *flags: str, default: float | None,
                 help: str, ms: bool = False, **kwargs: Any) -> None:
    """An option taking a duration with a unit; ``default`` in seconds. The value is seconds
    (float), or whole milliseconds with ``ms=True``."""
    shown = "" if default is None else f" (default: {format_duration(default)})"
    parser.add_argument(*flags, type=parse_duration_ms if ms else parse_duration,
                        default=(None if default is None
                                 else round(default * 1000) if ms else default),
                        metavar="DURATION", help=help + shown, **kwargs)


# --- host and port ----------------------------------------------------------------------------

def add_listen_options(parser: argparse.ArgumentParser, *, what: str, host_default: str | None,
                       port_help: str, host_help: str | None = None) -> None:
    """``--host``/``--port`` of the HTTP server a service runs."""
    parser.add_argument("--host", default=host_default, metavar="HOST",
                        help=host_help or f"interface {what} binds to")
    parser.add_argument("--port", type=port_number, default=None, metavar="PORT",
                        help=port_help)


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -2
    if not -1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0..65535)")
    return value


# --- logging ----------------------------------------------------------------------------------

LOG_LEVELS: Final = ("debug", "info", "warning", "error")


def add_logging_options(parser: argparse.ArgumentParser, *, default: str = "warning") -> None:
    """``--log-level`` and ``--log-format text|json`` (every long-running service)."""
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=default,
                        help="least severe log records written to stderr")
    parser.add_argument("--loglevel", type=str.lower, choices=LOG_LEVELS,
                        dest="log_level", help=argparse.SUPPRESS)  # the old spelling
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="text lines, or one JSON object per line (for log collectors)")


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: time (ISO 8601 UTC), level, logger, message, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
            "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def log_handler(log_format: str) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if log_format == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return handler


def configure_logging(args: argparse.Namespace) -> None:
    """The root logger as ``--log-level``/``--log-format`` ask (replacing its handlers)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(log_handler(getattr(args, "log_format", "text")))
    root.setLevel(getattr(args, "log_level", "warning").upper())


# --- colour -----------------------------------------------------------------------------------

def use_colour(stream: IO[str]) -> bool:
    """Colour only on a terminal, and never when ``NO_COLOR`` is set (no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
