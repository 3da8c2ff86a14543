"""``dsh-pipeline schemas``: the project's Avro schemas, offline (no registry needed).

``schemas list`` names each schema with its committed versions (``schemas/history/``);
``schemas show NAME [--version N]`` prints one; ``schemas check FILE`` tells whether a new
version of a schema could be registered: it reads data of every committed version of the
schema of the same full name, by the Avro resolution rules the registry's
``BACKWARD_TRANSITIVE`` check applies (:mod:`pipeline.codec.compatibility`). Exit 1 when it
could not, with one line per problem.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pipeline.cli.common import binary_input, input_name
from pipeline.core.errors import SchemaError
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "schemas", help="list, show and check the Avro schemas offline", description=__doc__)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="each schema with its committed versions")
    listing.set_defaults(func=run_list, uses_settings=False)
    show = actions.add_parser("show", help="print a schema (today's, or a committed version)")
    show.add_argument("name", metavar="NAME", help="schema name, e.g. dsh.SessionEvent")
    show.add_argument("--version", type=int, metavar="N", default=None,
                      help="the committed version N (default: today's schema)")
    show.set_defaults(func=run_show, uses_settings=False)
    check = actions.add_parser(
        "check", help="check a schema against every committed version (BACKWARD_TRANSITIVE)",
        description="Can FILE, as a new version, read data written with every committed "
                    "version of the schema of its name? The registry's BACKWARD_TRANSITIVE "
                    "check, offline. Exit 1 with one line per problem when it cannot.")
    check.add_argument("file", metavar="FILE", help="an .avsc file (- for stdin)")
    check.add_argument("--name", metavar="NAME", default=None,
                       help="check against this schema's history (default: FILE's full name)")
    check.set_defaults(func=run_check, uses_settings=False)


def _dirs() -> tuple[Path, Path]:
    from pipeline.codec.schemas import HISTORY_DIR, SCHEMA_DIR
    return SCHEMA_DIR, HISTORY_DIR


def history(name: str) -> list[tuple[int, Path]]:
    """The committed versions of schema ``name``, oldest first."""
    _, history_dir = _dirs()
    versions = []
    for path in history_dir.glob(f"{name}.v*.avsc"):
        version = path.name.removesuffix(".avsc").rsplit(".v", 1)[1]
        if version.isdigit():
            versions.append((int(version), path))
    return sorted(versions)


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SchemaError(f"cannot read schema {path}: {exc}") from None


def run_list(args: argparse.Namespace, settings: Settings) -> int:
    schema_dir, _ = _dirs()
    for path in sorted(schema_dir.glob("*.avsc")):
        name = path.name.removesuffix(".avsc")
        versions = history(name)
        latest = _load(versions[-1][1]) if versions else None
        state = (f"= v{versions[-1][0]}" if latest == _load(path)
                 else "changed since the last committed version" if versions else "new")
        listed = ", ".join(f"v{v}" for v, _ in versions) or "none"
        print(f"{name}  versions: {listed}  today: {state}")
    return 0


def run_show(args: argparse.Namespace, settings: Settings) -> int:
    schema_dir, _ = _dirs()
    if args.version is None:
        path = schema_dir / f"{args.name}.avsc"
    else:
        path = dict(history(args.name)).get(args.version, schema_dir / "(none)")
    if not path.is_file():
        known = sorted(p.name.removesuffix(".avsc") for p in schema_dir.glob("*.avsc"))
        raise SchemaError(f"no schema {args.name!r}" + (
            f" version {args.version}" if args.version is not None else "")
            + f"; known: {', '.join(known)}")
    print(json.dumps(_load(path), indent=2))
    return 0


def run_check(args: argparse.Namespace, settings: Settings) -> int:
    from pipeline.codec.compatibility import backward_transitive, full_name
    with binary_input(args.file) as handle:
        text = handle.read()
    try:
        candidate = json.loads(text)
    except ValueError as exc:
        raise SchemaError(f"{input_name(args.file)}: not JSON: {exc}") from None
    if not isinstance(candidate, dict) or "name" not in candidate:
        raise SchemaError(f"{input_name(args.file)}: not a named Avro schema (a record, enum "
                          "or fixed)")
    name = args.name or full_name(candidate)
    versions = history(name)
    if not versions:
        print(f"{name}: no committed version: nothing to be compatible with (a new subject)")
        return 0
    results = backward_transitive(candidate, [(f"v{v}", _load(p)) for v, p in versions])
    for label, problems in results.items():
        print(f"{name} {label}: " + ("ok" if not problems else f"{len(problems)} problem(s)"))
        for problem in problems:
            print(f"  {problem}")
    failed = any(results.values())
    print(f"{name}: {'NOT ' if failed else ''}compatible (BACKWARD_TRANSITIVE) with "
          f"{len(versions)} committed version(s)")
    return 1 if failed else 0
