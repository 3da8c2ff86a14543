"""``dsh-pipeline encode`` and ``dsh-pipeline decode``: session files <-> Avro containers.

``encode FILE -o OUT.avro`` reads a dsh session file (.jsonl or .jsonl.zstd, packed chunk
rows expanded) and writes an Avro object container file with the ``dsh.SessionEvent``
schema (deflate), readable by any Avro implementation; the session header goes into the
file metadata. ``decode IN.avro [-o OUT.jsonl]`` writes the header line and the events back
as JSONL, the same lines as the input's (``--packed`` packs chunk runs as dsh does).

``-`` reads stdin or writes stdout; an output that is the input file is refused. Neither reads
the ``DSH_*`` settings.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from typing import Any, TextIO

from pipeline.cli.common import STDIO, binary_input, input_name, is_stdio, refuse_overwrite
from pipeline.codec.container import read_container, write_container
from pipeline.codec.sessionfile import encode_lines, read_session_file, write_session_file
from pipeline.core.errors import CodecError, ConfigError, SessionFileError
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
    encode = subparsers.add_parser(
        "encode", help="write a session file as an Avro container file",
        description="Read a dsh session file and write its events as an Avro object "
                    "container file (schema dsh.SessionEvent, deflate).")
    encode.add_argument("file", metavar="FILE",
                        help="session file (.jsonl or .jsonl.zstd; - for stdin)")
    encode.add_argument("-o", "--output", metavar="OUT.avro", required=True,
                        help="the Avro file to write (- for stdout); never the input file")
    encode.add_argument("--session-id", metavar="ID", default=None,
                        help="session id for the records (default: the header's id, else "
                             "the file name)")
    encode.set_defaults(func=run_encode, uses_settings=False)

    decode = subparsers.add_parser(
        "decode", help="print the events of an Avro container file as JSONL",
        description="Read an Avro container written by 'encode' and write the session "
                    "header and events as JSONL (stdout unless -o).")
    decode.add_argument("file", metavar="IN.avro", help="the Avro container to read "
                                                        "(- for stdin)")
    decode.add_argument("-o", "--output", metavar="OUT.jsonl", default=STDIO,
                        help="session file to write (.jsonl, or .jsonl.zstd compressed; - for "
                             "stdout); never the input file")
    decode.add_argument("--packed", action="store_true",
                        help="pack runs of chunk deltas into chunk rows, as dsh writes them")
    decode.set_defaults(func=run_decode, uses_settings=False)


def run_encode(args: argparse.Namespace, settings: Settings) -> int:
    refuse_overwrite(args.output, args.file)
    if is_stdio(args.output) and sys.stdout.isatty():
        raise ConfigError("refusing to write binary Avro to a terminal: redirect stdout, or "
                          "give -o FILE")
    name = input_name(args.file)
    with binary_input(args.file) as handle:
        session_file = read_session_file(name, handle=handle)
    for warning in session_file.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    session_id = args.session_id or session_file.session_id or _stem(name)
    if is_stdio(args.output):
        count = write_container(sys.stdout.buffer, session_file.events, session_id=session_id,
                                header=session_file.header)
        sys.stdout.buffer.flush()
    else:
        count = _write_file(args.output, session_file, session_id)
    print(f"wrote {count} events of session {session_id} to {args.output}", file=sys.stderr)
    return 0


def _write_file(output: str, session_file: Any, session_id: str) -> int:
    """Written to a temporary name and renamed: a reader never sees half a file."""
    temporary = f"{output}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as handle:
            count = write_container(handle, session_file.events, session_id=session_id,
                                    header=session_file.header)
        os.replace(temporary, output)
    except OSError as exc:
        raise SessionFileError(f"cannot write {output}: {exc.strerror or exc}",
                               path=output) from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return count


def run_decode(args: argparse.Namespace, settings: Settings, out: TextIO | None = None) -> int:
    refuse_overwrite(args.output, args.file)
    name = input_name(args.file)
    with binary_input(args.file) as handle:
        # fastavro seeks in the container: a pipe is read into memory first
        seekable = handle if handle.seekable() else io.BytesIO(handle.read())
        container = read_container(seekable, name)
    sessions = {session_id for session_id, _ in container.events}
    if len(sessions) > 1:
        raise CodecError(f"{name}: holds {len(sessions)} sessions; a JSONL session file "
                         f"holds one")
    events = [event for _, event in container.events]
    if not is_stdio(args.output):
        write_session_file(args.output, events, header=container.header, packed=args.packed)
        return 0
    out = out or sys.stdout
    for line in encode_lines(events, header=container.header, packed=args.packed):
        out.write(line + "\n")
    return 0


def _stem(path: str) -> str:
    name = os.path.basename(path)
    for suffix in (".zstd", ".zst", ".jsonl"):
        name = name.removesuffix(suffix)
    return name
