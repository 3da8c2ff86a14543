"""The approval options of ``driver`` and ``send`` (kept out of ``cmd_driver`` for its size).

``driver --require-approval PATTERN`` (repeatable glob over tool names) and
``--approval-timeout DURATION`` make :class:`ApprovalRules`; ``send SESSION --approve CALL_ID``
/ ``--deny CALL_ID [--reason TEXT] [--by NAME]`` decide a waiting call, and ``send --configure
--require-approval PATTERN --approval-policy ask|never`` set a session's own rules.
See docs/approvals.md.
"""

from __future__ import annotations

import argparse
import getpass
from typing import Any

from pipeline.cli.common import add_duration
from pipeline.core.approvals import POLICIES, ApprovalRules
from pipeline.core.errors import ConfigError
from pipeline.core.inbox import Approve, Deny

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
        if args.reason is not None or args.by is not None:
            raise ConfigError("send --reason and --by only go with --approve or --deny")
        return None
    source = {"kind": "user", "name": args.by or _login()}
    decision = Approve if args.approve else Deny
    return decision(**common, call_id=call_id, reason=args.reason, source=source)


def _login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container): say nothing wrong
        return "unknown"
