"""``dsh-pipeline decode``: an Avro container file (written by ``encode``) as JSONL.

``decode IN.avro [-o OUT.jsonl]`` writes the header line and the events back as JSONL, the
same lines as the input of ``encode`` (:mod:`pipeline.cli.cmd_encode`); ``--packed`` packs
chunk runs as dsh does.

``-`` reads stdin or writes stdout; an output that is the input file is refused. It does not
read the ``DSH_*`` settings.
"""

from __future__ import annotations

import argparse
import io
import sys
from typing import Any, TextIO

from pipeline.cli.common import STDIO, binary_input, input_name, is_stdio, refuse_overwrite
from pipeline.codec.container import read_container
from pipeline.codec.sessionfile import encode_lines, write_session_file
from pipeline.core.errors import CodecError
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
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
