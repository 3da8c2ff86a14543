"""The approval options of ``driver`` and ``send`` (shared by ``cmd_driver`` and ``cmd_send``).

``driver --require-approval PATTERN`` (repeatable glob over tool names) and
``--approval-timeout DURATION`` make :class:`ApprovalRules`; ``send SESSION --approve CALL_ID``
/ ``--deny CALL_ID [--reason TEXT] [--by NAME]`` decide a waiting call, and ``send --configure
--require-approval PATTERN --approval-policy ask|never`` set a session's own rules.
See docs/approvals.md.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import sys
from typing import Any

from pipeline.adapters.kafka.decision_answer import send_and_wait
from pipeline.adapters.kafka.records import OutRecord
from pipeline.cli.common import EXIT_FAILED, EXIT_OK, add_duration
from pipeline.core.approvals import POLICIES, REFUSED_TYPE, ApprovalRules
from pipeline.core.errors import ConfigError
from pipeline.core.inbox import Approve, Deny
from pipeline.settings import Settings

CONFIGURE_APPROVAL_OPTIONS = ("require_approval", "approval_policy")


def add_driver_approval_options(driver: argparse.ArgumentParser) -> None:
    driver.add_argument("--require-approval", action="append", default=[], metavar="PATTERN",
                        dest="require_approval",
                        help="calls of tools whose name matches this glob (e.g. 'bash', "
                             "'mcp__github__*') wait for a person's send --approve/--deny; "
                             "repeatable; sessions may add their own with send --configure")
    add_duration(driver, "--approval-timeout", default=None, ms=True,
                 dest="approval_timeout_ms",
                 help="deny a call nobody decided within this time (default: wait for ever)")


def approval_rules(args: argparse.Namespace) -> ApprovalRules:
    return ApprovalRules(require=tuple(args.require_approval),
                         timeout_ms=args.approval_timeout_ms)


def add_send_approval_options(send: argparse.ArgumentParser, kind: Any) -> None:
    """``kind``: the mutually exclusive group of the command kinds."""
    kind.add_argument("--approve", metavar="CALL_ID",
                      help="let a tool call waiting for approval run (once)")
    kind.add_argument("--deny", metavar="CALL_ID",
                      help="refuse a tool call waiting for approval (the model gets an error "
                           "result with --reason)")
    send.add_argument("--reason", help="with --approve/--deny: why (logged; a denial's "
                                       "reason goes to the model)")
    send.add_argument("--by", help="with --approve/--deny: who decides, for the log "
                                   "(default: the login name)")
    send.add_argument("--wait", action="store_true",
                      help="with --approve/--deny: wait for the driver's answer in the session "
                           "log and print it (exit 1 when the decision was refused, e.g. "
                           "another decision came first)")
    add_duration(send, "--wait-timeout", default=30.0, dest="wait_timeout",
                 help="with --wait: how long to wait for the answer")
    send.add_argument("--require-approval", action="append", metavar="PATTERN",
                      dest="require_approval",
                      help="with --configure: this session's calls of matching tools wait for "
                           "approval too (repeatable; replaces the session's earlier list)")
    send.add_argument("--approval-policy", choices=POLICIES,
                      help="with --configure: ask (wait for a person) or never (reject "
                           "gated calls at once)")


def decision_from_args(args: argparse.Namespace, common: dict[str, Any]
                       ) -> Approve | Deny | None:
    """The ``--approve``/``--deny`` command, or None (another kind)."""
    call_id = args.approve or args.deny
    if call_id is None:
        if args.reason is not None or args.by is not None or args.wait:
            raise ConfigError("send --reason, --by and --wait only go with --approve or "
                              "--deny")
        return None
    source = {"kind": "user", "name": args.by or _login()}
    decision = Approve if args.approve else Deny
    return decision(**common, call_id=call_id, reason=args.reason, source=source)


def _login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container): say nothing wrong
        return "unknown"


def send_decision_and_wait(settings: Settings, command: Approve, record: OutRecord,
                           timeout_s: float) -> int:
    """``send --approve/--deny --wait``: print the usual line plus the driver's answer."""
    partition, offset, answer = asyncio.run(send_and_wait(
        settings, record, command.session_id, command.message_id, timeout_s))
    out = {"sessionId": command.session_id, "messageId": command.message_id,
           "kind": command.kind, "partition": partition, "offset": offset}
    if answer["type"] == REFUSED_TYPE:
        print(json.dumps({**out, "refused": answer.get("refusal")}))
        print(f"send: {answer.get('refusal')}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps({**out, "outcome": answer.get("outcome")}))
    return EXIT_OK
