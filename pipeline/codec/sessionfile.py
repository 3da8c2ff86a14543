"""Read and write dsh session files (format 0): ``.jsonl`` and ``.jsonl.zstd``.

Layout: line 1 is a header ``{"type":"session","version":0,"id",...}`` (optional here: the
spec's example has none); every later line is one event, or one packed chunk row that expands
to consecutive ``assistant/chunk`` events::

    {"type":"text-chunks"|"reasoning-chunks","seq0":S,"time0":T,
     "data":{"turn","step","index","dt":[...],"texts":[...]}}
    {"type":"tool-call-chunks","seq0":S,"time0":T,
     "data":{"turn","step","index","dt":[...],"id","name"?,"args":[...]}}

Member k becomes seq ``S+k`` at time ``T + dt[0] + ... + dt[k-1]`` (``len(dt) == n-1``) with
``data = {turn, step, chunk}`` and chunk ``{type:"text-delta"|"reasoning-delta", index, text}``
or ``{type:"tool-call-delta", index, id, name?, argumentsDelta}`` (``name`` on every member when
the row has one). Writing packs runs of at least 3 such deltas of one block (same kind, turn,
step, index; for tool calls the same id and name) whose events carry nothing else, at most 1024
per row, as dsh does; shorter runs stay event lines (the rows:
:mod:`pipeline.codec.packed_chunks`).

A ``.zstd`` file is concatenated zstd frames, stream-decompressed frame by frame. A torn tail
(an unterminated last line that does not parse, or an incomplete last zstd frame) is dropped
with a warning, returned to the caller (the codec prints nothing), and its size counted in
``SessionFile.dropped_bytes`` (so a checker can refuse it). Every other problem is a
:class:`SessionFileError` naming the path and the line: bad UTF-8 or JSON, non-lossless
numbers, a bad header or packed row, an envelope error, a seq gap or repeat.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, Final

import zstandard

from pipeline.codec.packed_chunks import PACKED_TYPES, expand_packed_row, pack_chunks
from pipeline.core.errors import DshError, EventError, SessionFileError
from pipeline.core.events import Event, JsonValue, event_from_json
from pipeline.core.log import Mode, SessionLog
from pipeline.core.lossless import (
    LosslessJsonError,
    dumps_json_safe,
    has_lone_surrogate,
    loads_lossless,
)

ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
_READ_BLOCK: Final = 1 << 20
_FRAME_LINES: Final = 4096  # lines per zstd frame when writing


@dataclass(frozen=True, slots=True)
class FileProblem:
    """One problem found in a file: where, and the error (EventError keeps seq/type/rule)."""

    path: str
    line: int | None
    error: DshError

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else self.path
        error = self.error
        if isinstance(error, EventError):
            parts = [f"seq {error.seq}" if error.seq is not None else None,
                     f"type {error.type}" if error.type is not None else None]
            head = ", ".join(p for p in parts if p)
            rule = f" [rule: {error.rule}]" if error.rule else ""
            return f"{where}: {head + ': ' if head else ''}{error.detail}{rule}"
        detail = str(error)
        prefix = f"{where}: "
        return detail if detail.startswith(prefix) else prefix + detail

    def as_error(self) -> SessionFileError:
        return SessionFileError(str(self), path=self.path, line=self.line)


@dataclass(frozen=True)
class SessionFile:
    """A read session file: header (None if absent), events, the line of each event."""

    path: str
    header: dict[str, JsonValue] | None
    events: tuple[Event, ...]
    lines: tuple[int, ...]
    warnings: tuple[str, ...] = ()
    _line_by_seq: dict[int, int] = field(default_factory=dict, repr=False, compare=False)
    dropped_bytes: int = 0  # of a torn tail (last line or zstd frame), 0 when none

    @property
    def session_id(self) -> str | None:
        value = self.header.get("id") if self.header else None
        return value if isinstance(value, str) else None

    def line_of(self, seq: int) -> int | None:
        """The 1-based line holding event ``seq`` (a packed row holds several)."""
        return self._line_by_seq.get(seq)


# --- reading ---------------------------------------------------------------------------------

def read_session_file(path: str | os.PathLike[str], *,
                      handle: IO[bytes] | None = None) -> SessionFile:
    """Read a whole file; the first problem raises :class:`SessionFileError`.

    ``handle``: read from this stream instead (stdin), ``path`` naming it in messages.
    """
    result, problems = scan_session_file(path, handle=handle)
    if problems:
        raise problems[0].as_error() from problems[0].error
    return result


def scan_session_file(path: str | os.PathLike[str], *, handle: IO[bytes] | None = None
                      ) -> tuple[SessionFile, list[FileProblem]]:
    """Read a file, collecting every line problem instead of stopping at the first.

    Bad lines are skipped; after one, the next event's seq is taken as is (no second report
    for the same hole). The returned events are therefore contiguous only when there are no
    problems. ``handle``: read this stream (not seekable: stdin) instead of opening ``path``.
    """
    name = os.fspath(path)
    warnings: list[str] = []
    problems: list[FileProblem] = []
    dropped: list[int] = []
    reader = _Reader(name, warnings, problems, dropped)
    try:
        if handle is not None:
            reader.consume(_lines(_decoded_chunks(handle, name, warnings, dropped)))
        else:
            with open(name, "rb") as opened:
                reader.consume(_lines(_decoded_chunks(opened, name, warnings, dropped)))
    except OSError as exc:
        raise SessionFileError(f"{name}: cannot read: {exc.strerror or exc}", path=name) from exc
    except SessionFileError as exc:
        problems.append(FileProblem(name, exc.line, exc))
        reader_events: tuple[Event, ...] = ()
        return SessionFile(name, None, reader_events, (), tuple(warnings)), problems
    events = tuple(reader.events)
    lines = tuple(reader.lines)
    by_seq = {event.seq: line for event, line in zip(events, lines, strict=True)}
    return SessionFile(name, reader.header, events, lines, tuple(warnings), by_seq,
                       sum(dropped)), problems


def load_session(path: str | os.PathLike[str], *, mode: Mode = "ingest",
                 handle: IO[bytes] | None = None) -> tuple[SessionFile, SessionLog]:
    """Read and fold a file. A refused event raises :class:`SessionFileError` with its line
    (the :class:`EventError` is its ``__cause__``)."""
    session_file = read_session_file(path, handle=handle)
    log = SessionLog(session_file.session_id or "", mode=mode)
    for event, line in zip(session_file.events, session_file.lines, strict=True):
        try:
            log.append(event)
        except EventError as exc:
            raise FileProblem(session_file.path, line, exc).as_error() from exc
    return session_file, log


def _blocks(handle: IO[bytes]) -> Iterator[bytes]:
    while block := handle.read(_READ_BLOCK):
        yield block


def _decoded_chunks(handle: IO[bytes], path: str, warnings: list[str],
                    dropped: list[int]) -> Iterator[bytes]:
    """The file's bytes, decompressed when it starts with a zstd frame (never seeks: the
    handle may be a pipe)."""
    first = handle.read(_READ_BLOCK)
    blocks = _blocks(handle)
    if first[:4] == ZSTD_MAGIC:
        yield from _zstd_chunks(_chained(first, blocks), path, warnings, dropped)
        return
    if path.endswith((".zstd", ".zst")) and first:
        raise SessionFileError(f"{path}: named like a zstd file but does not start with a "
                               "zstd frame", path=path)
    yield from _chained(first, blocks)


def _chained(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest


def _zstd_chunks(blocks: Iterable[bytes], path: str, warnings: list[str],
                 dropped: list[int]) -> Iterator[bytes]:
    """Decompress concatenated frames; a frame's output is yielded once the frame is whole."""
    decompressor = zstandard.ZstdDecompressor()
    frame: Any = None
    frame_output: list[bytes] = []
    offset = 0
    frame_start = 0  # where the frame being decompressed began in the file
    for block in blocks:
        data = block
        while data:
            if frame is None:
                frame = decompressor.decompressobj()
                frame_output = []
            try:
                frame_output.append(frame.decompress(data))
            except zstandard.ZstdError as exc:
                raise SessionFileError(f"{path}: corrupt zstd data near byte {offset}: {exc}",
                                       path=path) from exc
            if not frame.eof:
                break
            yield b"".join(frame_output)
            data = frame.unused_data
            frame_start = offset + len(block) - len(data)
            frame = None
        offset += len(block)
    if frame is not None:
        warnings.append(f"{path}: torn zstd frame at the end of the file was dropped "
                        f"({offset - frame_start} bytes)")
        dropped.append(offset - frame_start)


def _lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, line bytes without newline, terminated by a newline)."""
    carry = b""
    number = 0
    for chunk in chunks:
        parts = (carry + chunk).split(b"\n") if carry else chunk.split(b"\n")
        carry = parts.pop()
        for part in parts:
            number += 1
            yield number, part, True
    if carry:
        yield number + 1, carry, False


class _Reader:
    """Turns lines into header + events, recording problems with their line numbers."""

    def __init__(self, path: str, warnings: list[str], problems: list[FileProblem],
                 dropped: list[int]) -> None:
        self.path = path
        self.warnings = warnings
        self.dropped = dropped
        self.problems = problems
        self.header: dict[str, JsonValue] | None = None
        self.events: list[Event] = []
        self.lines: list[int] = []
        self.expected = 0
        self.resync = False
        self.seen_content = False

    def consume(self, lines: Iterable[tuple[int, bytes, bool]]) -> None:
        pending: tuple[int, bytes, bool] | None = None
        for item in lines:
            if pending is not None:
                self._line(*pending, last=False)
            pending = item
        if pending is not None:
            self._line(*pending, last=True)

    def _problem(self, line: int, error: DshError) -> None:
        self.problems.append(FileProblem(self.path, line, error))
        self.resync = True

    def _line(self, number: int, raw: bytes, terminated: bool, *, last: bool) -> None:
        raw = raw.removesuffix(b"\r")
        if number == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte order mark an editor added
        if not raw.strip():
            return
        try:
            obj = loads_lossless(raw.decode("utf-8"))
        except UnicodeDecodeError:
            self._problem(number, SessionFileError("line is not valid UTF-8"))
            return
        except LosslessJsonError as exc:
            self._problem(number, SessionFileError(f"not lossless JSON: {exc}"))
            return
        except (ValueError, RecursionError) as exc:
            if last and not terminated:
                self.warnings.append(f"{self.path}:{number}: torn last line dropped "
                                     f"({len(raw)} bytes)")
                self.dropped.append(len(raw))
                return
            self._problem(number, SessionFileError(f"not valid JSON: {_short(exc)}"))
            return
        first = not self.seen_content
        self.seen_content = True
        try:
            if first and _is_header(obj):
                self.header = _check_header(obj)
            else:
                self._add(number, obj)
        except DshError as exc:
            self._problem(number, exc)

    def _add(self, number: int, obj: JsonValue) -> None:
        row_type = obj.get("type") if isinstance(obj, dict) else None
        if isinstance(row_type, str) and row_type in PACKED_TYPES and "seq" not in obj:
            new_events = expand_packed_row(obj)
        else:
            new_events = [event_from_json(obj)]
        first = new_events[0]
        if first.seq != self.expected and not self.resync:
            kind = "gap" if first.seq > self.expected else "repeat"
            raise SessionFileError(f"seq {kind}: expected seq {self.expected}, found "
                                   f"{first.seq} (type {first.type})")
        self.resync = False
        self.events.extend(new_events)
        self.lines.extend([number] * len(new_events))
        self.expected = new_events[-1].seq + 1


def _short(exc: BaseException) -> str:
    return str(exc)[:200] or type(exc).__name__


def _is_header(obj: JsonValue) -> bool:
    return isinstance(obj, dict) and obj.get("type") == "session" and "seq" not in obj


def _check_header(obj: dict[str, JsonValue]) -> dict[str, JsonValue]:
    if obj.get("version") != 0 or type(obj.get("version")) is not int:
        raise SessionFileError(f"unsupported session format version {obj.get('version')!r} "
                               "(this reader knows version 0)")
    if not isinstance(obj.get("id"), str):
        raise SessionFileError("the session header needs a string 'id'")
    return obj


# --- writing ---------------------------------------------------------------------------------

def encode_lines(events: Iterable[Event], *, header: dict[str, JsonValue] | None = None,
                 packed: bool = False) -> Iterator[str]:
    """The file's lines (without newlines): header first, then events or packed rows."""
    if header is not None:
        yield dumps_json_safe(header)
    if not packed:
        for event in events:
            yield _event_line(event)
        return
    for item in pack_chunks(events):
        yield _event_line(item) if isinstance(item, Event) else dumps_json_safe(item)


def _event_line(event: Event) -> str:
    """``event.to_line()``, ASCII-escaped when it holds a lone surrogate (see lossless.py)."""
    line = event.to_line()
    return dumps_json_safe(event.to_json()) if has_lone_surrogate(line) else line


def write_session_file(path: str | os.PathLike[str], events: Iterable[Event], *,
                       header: dict[str, JsonValue] | None = None, packed: bool = False,
                       compress: bool | None = None) -> None:
    """Write a session file; ``compress`` None: zstd when the name ends in .zstd/.zst.

    Written to a temporary name and renamed, so a reader never sees half a file.
    """
    name = os.fspath(path)
    use_zstd = name.endswith((".zstd", ".zst")) if compress is None else compress
    lines = encode_lines(events, header=header, packed=packed)
    temporary = f"{name}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as handle:
            if use_zstd:
                _write_zstd(handle, lines)
            else:
                _write_plain(handle, lines)
        os.replace(temporary, name)
    except OSError as exc:
        raise SessionFileError(f"{name}: cannot write: {exc.strerror or exc}",
                               path=name) from exc
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _write_plain(handle: IO[bytes], lines: Iterable[str]) -> None:
    buffer = io.TextIOWrapper(handle, encoding="utf-8", newline="\n", write_through=False)
    for line in lines:
        buffer.write(line)
        buffer.write("\n")
    buffer.flush()
    buffer.detach()


def _write_zstd(handle: IO[bytes], lines: Iterable[str]) -> None:
    """One zstd frame per batch of lines: the file is concatenated frames, as dsh writes."""
    compressor = zstandard.ZstdCompressor(level=3, write_checksum=True)  # as dsh frames are
    batch: list[str] = []
    for line in lines:
        batch.append(line)
        if len(batch) >= _FRAME_LINES:
            handle.write(compressor.compress(("\n".join(batch) + "\n").encode("utf-8")))
            batch = []
    if batch:
        handle.write(compressor.compress(("\n".join(batch) + "\n").encode("utf-8")))
