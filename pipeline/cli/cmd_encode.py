"""``dsh-pipeline encode``: a session file as an Avro container file.

``encode FILE -o OUT.avro`` reads a dsh session file (.jsonl or .jsonl.zstd, packed chunk
rows expanded) and writes an Avro object container file with the ``dsh.SessionEvent``
schema (deflate), readable by any Avro implementation; the session header goes into the
file metadata. ``decode`` (:mod:`pipeline.cli.cmd_decode`) reads it back.

``-`` reads stdin or writes stdout; an output that is the input file is refused. It does not
read the ``DSH_*`` settings.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pipeline.cli.common import binary_input, input_name, is_stdio, refuse_overwrite
from pipeline.codec.container import write_container
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import ConfigError, SessionFileError
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


def _stem(path: str) -> str:
    name = os.path.basename(path)
    for suffix in (".zstd", ".zst", ".jsonl"):
        name = name.removesuffix(suffix)
    return name
