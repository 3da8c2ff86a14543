"""The ``dsh-pipeline`` command: the composition root.

Each command lives in its own module under :mod:`pipeline.cli` with a ``register(subparsers)``
function that adds its parser and sets ``func`` (a callable taking the parsed namespace and the
settings, returning the exit code). Only this package picks adapters.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pipeline.core.errors import DshError
from pipeline.settings import Settings

# One module per command group, registered in this order (the order of --help).
COMMAND_MODULES: tuple[str, ...] = (
    "pipeline.cli.cmd_derive",
    "pipeline.cli.cmd_broker",
    "pipeline.cli.cmd_topics",
    "pipeline.cli.cmd_demo",
    "pipeline.cli.cmd_config",
    "pipeline.cli.cmd_driver",
    "pipeline.cli.cmd_processors",
    "pipeline.cli.cmd_avro",
    "pipeline.cli.cmd_fanout",
    "pipeline.cli.cmd_dashboard",
    "pipeline.cli.cmd_bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsh-pipeline",
        description="Run and observe fleets of AI agents on Kafka (dsh session logs).",
        epilog="Settings come from DSH_* environment variables; see README.md.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # a command group not built yet
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings_or_none: Settings | None = None
    try:
        settings = settings_or_none = Settings.from_env()
        code: int = args.func(args, settings)
        return code
    except DshError as exc:
        print(f"dsh-pipeline {args.command}: error: {exc}{_as_principal(settings_or_none)}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _as_principal(settings: Settings | None) -> str:
    """Who the command was (the SASL user name; never the password)."""
    if settings is None or not settings.sasl_username:
        return ""
    return f" [as principal User:{settings.sasl_username}]"


if __name__ == "__main__":
    sys.exit(main())
