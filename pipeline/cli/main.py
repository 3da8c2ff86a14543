"""The ``dsh-pipeline`` command: the composition root.

Each command lives in its own module under :mod:`pipeline.cli` with a ``register(subparsers)``
function that adds its parser and sets ``func`` (a callable taking the parsed namespace and the
settings, returning the exit code). Only this package picks adapters.

Start-up stays fast: only the module of the command being run is imported
(``PRODUCT_COMMANDS`` and :func:`commands` map each command to its module and its one-line
summary for the top-level ``--help``), so the file commands never load Kafka, faust or
aiohttp, and a product command reads no entry point. A command missing from them still works:
every module is then imported. A command that sets ``uses_settings=False`` gets the default
settings, never the environment's: a bad ``DSH_*`` variable cannot break it. Exit codes:
:mod:`pipeline.cli.common`.

Other installed distributions add commands through the entry-point group
``dsh_pipeline.commands`` (:data:`COMMANDS_GROUP`): the development package (``dev/``,
``dsh-pipeline-dev``) adds ``broker``, ``demo``, ``chaos`` and ``bench`` (a checkout run with
``dev/`` on ``PYTHONPATH`` but not installed finds them too). Without it those commands exit 2
saying how to install it.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from pipeline.cli.common import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    new_parser,
)
from pipeline.core.errors import ConfigError, DshError
from pipeline.settings import Settings

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

# One module per command or command group, registered in this order (the order of --help).
PRODUCT_MODULES: tuple[str, ...] = (
    "pipeline.cli.cmd_derive",
    "pipeline.cli.cmd_validate",
    "pipeline.cli.cmd_encode",
    "pipeline.cli.cmd_decode",
    "pipeline.cli.cmd_certs",
    "pipeline.cli.cmd_topics",
    "pipeline.cli.cmd_config",
    "pipeline.cli.cmd_driver",
    "pipeline.cli.cmd_send",
    "pipeline.cli.cmd_processors",
    "pipeline.cli.cmd_tail",
    "pipeline.cli.cmd_export",
    "pipeline.cli.cmd_import",
    "pipeline.cli.cmd_ship",
    "pipeline.cli.cmd_replay",
    "pipeline.cli.cmd_check",
    "pipeline.cli.cmd_dashboard",
    "pipeline.cli.cmd_otel",
    "pipeline.cli.cmd_schemas",
    "pipeline.cli.cmd_sessions",
    "pipeline.cli.cmd_usage",
    "pipeline.cli.cmd_completion",
)

# command -> (its module, its summary in the top-level --help). A test keeps the summaries
# equal to each parser's help; a command missing here makes every module load (slower).
PRODUCT_COMMANDS: dict[str, tuple[str, str]] = {
    "derive": ("pipeline.cli.cmd_derive",
               "show a session file's turns and the messages the model sees"),
    "validate": ("pipeline.cli.cmd_validate", "check session files against the session-log rules"),
    "encode": ("pipeline.cli.cmd_encode", "write a session file as an Avro container file"),
    "decode": ("pipeline.cli.cmd_decode", "print the events of an Avro container file as JSONL"),
    "certs": ("pipeline.cli.cmd_certs", "write a secure deployment's CA, certificates and "
                                        "per-role credentials"),
    "topics": ("pipeline.cli.cmd_topics", "create and check the project's topics (and register "
                                          "schemas)"),
    "config": ("pipeline.cli.cmd_config", "print every setting: env variable, default, current "
                                          "value (secrets masked)"),
    "driver": ("pipeline.cli.cmd_driver", "run agent turns from the inbox topic"),
    "send": ("pipeline.cli.cmd_send", "put one command on a session's inbox"),
    "processors": ("pipeline.cli.cmd_processors", "run a stream-processors worker (derived "
                                                  "messages, usage, fleet)"),
    "tail": ("pipeline.cli.cmd_tail", "live readable view of session events"),
    "export": ("pipeline.cli.cmd_export", "write a session as a dsh JSONL file"),
    "import": ("pipeline.cli.cmd_import", "publish dsh session files (idempotent)"),
    "ship": ("pipeline.cli.cmd_ship", "follow a directory of dsh session files"),
    "replay": ("pipeline.cli.cmd_replay", "rebuild derived messages into a new version (or "
                                          "print one session)"),
    "check": ("pipeline.cli.cmd_check", "fsck of the session topic (JSON summary)"),
    "sessions": ("pipeline.cli.cmd_sessions", "list the sessions of the fleet (from the "
                                              "processors' outputs)"),
    "usage": ("pipeline.cli.cmd_usage", "print the cost ledger: tokens and cost per tenant, "
                                        "model and hour"),
    "dashboard": ("pipeline.cli.cmd_dashboard", "serve the live fleet dashboard (web page, "
                                                "JSON/SSE API, /metrics)"),
    "otel": ("pipeline.cli.cmd_otel", "export turns as OpenTelemetry GenAI traces over "
                                      "OTLP/HTTP"),
    "schemas": ("pipeline.cli.cmd_schemas", "list, show and check the Avro schemas offline"),
    "completion": ("pipeline.cli.cmd_completion", "print a shell completion script (bash, zsh)"),
}


# Commands of other installed distributions: each registers, in this entry-point group, a
# table like PRODUCT_COMMANDS (command -> (module, summary)). The development package (dev/,
# dsh-pipeline-dev: the local stack, the chaos campaign, the benchmarks) registers its own.
COMMANDS_GROUP: Final = "dsh_pipeline.commands"
# Named here only to say how to get them when the development package is not installed.
DEVELOPMENT_COMMANDS: Final = ("broker", "demo", "chaos", "bench")
DEVELOPMENT_PACKAGE: Final = "dsh-pipeline-dev"
# The development package's entry point (group:value). A checkout run that puts dev/ on
# PYTHONPATH without installing it has no entry point: the same table is then read when its
# package is importable (by name, at run time: the product never imports the development
# package).
DEVELOPMENT_TABLE: Final = "dsh_dev.cli.commands:COMMANDS"


def command_tables() -> list[EntryPoint]:
    """The entry points of the group, plus the development package's when it is importable
    but not installed."""
    from importlib.metadata import EntryPoint, entry_points  # scans every installed package
    found = sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name)
    if (all(entry.value != DEVELOPMENT_TABLE for entry in found)
            and importlib.util.find_spec(DEVELOPMENT_TABLE.split(".")[0]) is not None):
        found.append(EntryPoint(name="dev", value=DEVELOPMENT_TABLE, group=COMMANDS_GROUP))
    return found


def installed_commands() -> dict[str, tuple[str, str]]:
    """The commands other installed distributions add (none may replace a product command).
    A table that fails to load is reported on stderr and skipped: the product's commands
    still work."""
    found: dict[str, tuple[str, str]] = {}
    for entry in command_tables():
        try:
            table = entry.load()
        except Exception as exc:  # a broken plugin must not break the product's commands
            print(f"dsh-pipeline: the commands of {entry.value} are left out: {exc}",
                  file=sys.stderr)
            continue
        found.update({name: (str(module), str(summary))
                      for name, (module, summary) in dict(table).items()
                      if name not in PRODUCT_COMMANDS})
    return found


@functools.cache
def commands() -> dict[str, tuple[str, str]]:
    """Every command: the product's, then the installed distributions' (their entry points
    are read on the first call, not at import: a product command never reads them)."""
    return {**PRODUCT_COMMANDS, **installed_commands()}


def command_modules() -> tuple[str, ...]:
    """Every command's module, in --help order."""
    return (*PRODUCT_MODULES,
            *dict.fromkeys(module for name, (module, _) in commands().items()
                           if name not in PRODUCT_COMMANDS))


def missing_development_command(command: str | None) -> str | None:
    """What to say when ``command`` is one of the development package's and it is missing."""
    if command not in DEVELOPMENT_COMMANDS or command in commands():
        return None
    return (f"dsh-pipeline {command}: error: `{command}` is a development command, in the "
            f"development package {DEVELOPMENT_PACKAGE}, which is not installed. From a "
            "checkout of the repository: `pip install -e ./dev` (`make setup` does it).")


def version() -> str:
    try:
        from importlib.metadata import version as installed_version
        return installed_version("dsh-pipeline")
    except Exception:  # not installed (run from a clone with PYTHONPATH)
        return "0+unknown"


def build_parser(command: str | None = "") -> argparse.ArgumentParser:
    """The parser. ``command`` "" (the default): every command, fully; None: every command as
    a summary only (the top-level help, nothing imported); a name: that command fully."""
    parser = new_parser(
        prog="dsh-pipeline",
        description="Run and observe fleets of AI agents on Kafka (dsh session logs).",
        epilog="Settings come from DSH_* environment variables (dsh-pipeline config). Exit "
               "codes: 0 ok, 1 invalid input or failed check, 2 usage error, 130 interrupted. "
               "Docs: docs/cli.md." + _development_note())
    parser.add_argument("--version", action="version", version=f"dsh-pipeline {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if command is None:
        for name, (_, summary) in commands().items():
            sub.add_parser(name, help=summary)
        return parser
    known = PRODUCT_COMMANDS.get(command) if command else None  # no entry point read
    if command and known is None:
        known = commands().get(command)
    wanted = known[0] if known is not None else ""
    for module_name in [wanted] if wanted else command_modules():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # a command group not built yet
            raise
        module.register(sub)
    return parser


def _development_note() -> str:
    missing = [name for name in DEVELOPMENT_COMMANDS if name not in commands()]
    if not missing:
        return ""
    return (f" Development commands ({', '.join(missing)}): install the development package "
            f"{DEVELOPMENT_PACKAGE} (`pip install -e ./dev` in a checkout).")


def command_in(argv: Sequence[str]) -> str | None:
    """The command named in ``argv`` (its first word that is no option), or None."""
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command = command_in(words)
    missing = missing_development_command(command)
    if missing is not None:
        print(missing, file=sys.stderr)
        return EXIT_USAGE
    try:
        parser = build_parser(None if command is None else command)
        args = parser.parse_args(words)
    except SystemExit as exc:  # --help, --version, or a usage error argparse printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:  # while the command's modules were still loading
        return EXIT_INTERRUPTED
    settings_or_none: Settings | None = None
    try:
        settings = settings_or_none = (Settings.from_env()
                                       if getattr(args, "uses_settings", True) else Settings())
        code: int = args.func(args, settings)
        sys.stdout.flush()
        return code
    except ConfigError as exc:
        return _error(args, exc, EXIT_USAGE, settings_or_none)
    except DshError as exc:
        return _error(args, exc, EXIT_FAILED, settings_or_none)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away: say nothing more on stdout (Python would complain again
        # when it flushes at exit).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _error(args: argparse.Namespace, exc: DshError, code: int,
           settings: Settings | None) -> int:
    print(f"dsh-pipeline {args.command}: error: {exc}{_as_principal(settings)}",
          file=sys.stderr)
    return code


def _as_principal(settings: Settings | None) -> str:
    """Who the command was (the SASL user name; never the password)."""
    if settings is None or not settings.sasl_username:
        return ""
    return f" [as principal User:{settings.sasl_username}]"


if __name__ == "__main__":
    sys.exit(main())
