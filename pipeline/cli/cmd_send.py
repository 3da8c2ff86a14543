"""``dsh-pipeline send``: put one command on a session's inbox.

``send SESSION`` puts one command on the inbox: ``--followup TEXT``, ``--steer TEXT``,
``--inject TEXT`` (or the text from a file or stdin: ``--followup --text-file F|-``, for texts
longer than a command line may be), ``--cancel [--keep-queue]`` or ``--configure`` with any
of ``--provider``, ``--model``, ``--system``, ``--tools a,b``, ``--reasoning-effort``,
``--max-tokens``, ``--require-approval P``, ``--approval-policy``, or ``--approve CALL_ID`` /
``--deny CALL_ID`` (approval options: :mod:`pipeline.cli.approval_options`); any of them
with ``--tenant T`` (the session's tenant: :mod:`pipeline.core.tenants`). It prints
one JSON line ``{"sessionId", "messageId", "kind", "partition", "offset"}``. The ``driver``
that runs the commands: :mod:`pipeline.cli.cmd_driver`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import Any

from pipeline.adapters.kafka.plain_producer import inbox_command_record, send_records
from pipeline.adapters.registry.client import RegistryClient
from pipeline.cli.approval_options import (
    CONFIGURE_APPROVAL_OPTIONS,
    add_send_approval_options,
    decision_from_args,
    send_decision_and_wait,
)
from pipeline.cli.common import add_session_argument
from pipeline.cli.registry_codecs import registry_codecs
from pipeline.codec.inbox import InboxCodec
from pipeline.core.errors import ConfigError, SessionFileError
from pipeline.core.inbox import Approve, Cancel, Configure, FollowUp, InboxCommand, Inject, Steer
from pipeline.core.tenants import checked_tenant
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
    send = subparsers.add_parser(
        "send", help="put one command on a session's inbox",
        description="Put one command on the inbox topic, keyed by SESSION: a follow-up, a "
                    "steer, an inject (text as an argument, or from --text-file FILE or stdin "
                    "with -), a cancel, a configure, or a decision on a tool call waiting for "
                    "approval. Prints one JSON line {sessionId, "
                    "messageId, kind, partition, offset}.")
    add_session_argument(send)
    kind = send.add_mutually_exclusive_group(required=True)
    for flag, what in (("followup", "a follow-up (next turn)"),
                       ("steer", "steering (next step; wakes)"),
                       ("inject", "context (next step; does not wake)")):
        kind.add_argument(f"--{flag}", metavar="TEXT", nargs="?", const=FROM_FILE,
                          help=f"{what}; without TEXT, the text comes from --text-file")
    kind.add_argument("--cancel", action="store_true", help="abort the current turn")
    kind.add_argument("--configure", action="store_true", help="change the configuration")
    send.add_argument("--text-file", metavar="FILE",
                      help="read the text of --followup, --steer or --inject from FILE (- for "
                           "stdin; UTF-8)")
    send.add_argument("--keep-queue", action="store_true", help="with --cancel")
    for name, what in (("provider", "model provider"), ("model", "model name"),
                       ("system", "system prompt"),
                       ("reasoning-effort", "reasoning effort (provider-specific)")):
        send.add_argument(f"--{name}", help=f"with --configure: the {what}")
    send.add_argument("--tools", help="with --configure: comma-separated tool names ('' = none)")
    send.add_argument("--max-tokens", type=int, help="with --configure: the output token limit")
    add_send_approval_options(send, kind)
    send.add_argument("--message-id", help="the command's message id (default: a new UUID)")
    send.add_argument("--tenant", metavar="T",
                      help="the tenant the session belongs to: the session's first command "
                           "sets it (default: the default tenant, empty); a later command "
                           "naming another tenant is refused by the driver (dead letter)")
    send.add_argument("--registry", action="store_true",
                      help="Confluent framing with the id registered at DSH_REGISTRY_URL")
    send.set_defaults(func=run_send)


def command_from_args(args: argparse.Namespace) -> InboxCommand:
    """The command ``send``'s arguments describe (ConfigError when they do not fit)."""
    _check_send_options(args)
    common = {"session_id": args.session, "message_id": args.message_id or str(uuid.uuid4()),
              "tenant": checked_tenant(args.tenant) if args.tenant is not None else None}
    decision = decision_from_args(args, common)
    if decision is not None:
        return decision
    for flag, cls in (("followup", FollowUp), ("steer", Steer), ("inject", Inject)):
        text = getattr(args, flag)
        if text is not None:
            text = _text_of(flag, text, args.text_file)
            return cls(**common, content=({"type": "text", "text": text},))
    if args.cancel:
        return Cancel(**common, keep_queue=args.keep_queue)
    tools = None if args.tools is None else tuple(t for t in args.tools.split(",") if t)
    configure = Configure(**common, provider=args.provider, model=args.model,
                          system=args.system, tools=tools,
                          reasoning_effort=args.reasoning_effort, max_tokens=args.max_tokens,
                          require_approval=(None if args.require_approval is None
                                            else tuple(args.require_approval)),
                          approval_policy=args.approval_policy)
    if all(getattr(configure, f) is None for f in CONFIGURE_OPTIONS):
        raise ConfigError("send --configure needs at least one of --provider, --model, "
                          "--system, --tools, --reasoning-effort, --max-tokens, "
                          "--require-approval, --approval-policy")
    return configure


FROM_FILE = "\0from --text-file"  # --followup/--steer/--inject given without TEXT


def _text_of(flag: str, given: str, text_file: str | None) -> str:
    """The text of a follow-up, steer or inject: the argument, or the file's content."""
    if given != FROM_FILE:
        if text_file is not None:
            raise ConfigError(f"send --{flag} TEXT and --text-file: give the text once")
        return given
    if text_file is None:
        raise ConfigError(f"send --{flag} needs TEXT or --text-file FILE")
    try:
        if text_file == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        with open(text_file, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise SessionFileError(f"{text_file}: cannot read: {exc.strerror or exc}",
                               path=text_file) from None
    except UnicodeDecodeError as exc:
        raise SessionFileError(f"{text_file}: not UTF-8 text ({exc.reason} at byte "
                               f"{exc.start})", path=text_file) from None


CONFIGURE_OPTIONS = ("provider", "model", "system", "tools", "reasoning_effort", "max_tokens",
                     *CONFIGURE_APPROVAL_OPTIONS)


def _check_send_options(args: argparse.Namespace) -> None:
    if args.keep_queue and not args.cancel:
        raise ConfigError("send --keep-queue only goes with --cancel")
    if args.text_file is not None and not (args.followup or args.steer or args.inject):
        raise ConfigError("send --text-file only goes with --followup, --steer or --inject")
    given = [f"--{o.replace('_', '-')}" for o in CONFIGURE_OPTIONS if getattr(args, o) is not None]
    if given and not args.configure:
        raise ConfigError(f"send {' '.join(given)} only go(es) with --configure")


def run_send(args: argparse.Namespace, settings: Settings) -> int:
    try:
        command = command_from_args(args)
    except (ConfigError, SessionFileError):
        raise
    except Exception as exc:  # EventError from the command's own checks
        raise ConfigError(f"send: {exc}") from None
    if args.registry:
        with RegistryClient.from_settings(settings) as client:
            codec = registry_codecs(settings, client)[1]
    else:
        codec = InboxCodec()
    record = inbox_command_record(settings, command, codec.encode)
    if isinstance(command, Approve) and args.wait:
        return send_decision_and_wait(settings, command, record, args.wait_timeout)
    [(partition, offset)] = asyncio.run(send_records(settings, [record]))
    print(json.dumps({"sessionId": command.session_id, "messageId": command.message_id,
                      "kind": command.kind, "partition": partition, "offset": offset}))
    return 0
