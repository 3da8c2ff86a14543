"""``dsh-pipeline demo``: the whole pipeline on a local stack, with a live dashboard.

Starts the local stack in-process (or uses ``DSH_BOOTSTRAP_SERVERS`` with ``--external``),
ensures the project's topics and starts the dashboard (its URL printed first). Then:

1. publishes every event of the sample sessions (``samples/sessions/*.jsonl`` of the
   current directory, a checkout's top, recorded from the project's own driver by
   ``bench/record_samples.py``; ``--samples DIR`` for others) to the session-events topic,
   Avro-encoded, keyed by session id, with the type and seq headers, and reads them back byte
   for byte;
2. unless ``--sessions 0``: runs N scripted agent sessions through the Kafka driver and a
   processors worker (:mod:`dsh_dev.cli.demo_fleet`), and checks every session's derived
   messages and usage in the processors against core's folds of its log.

Prints one summary line (``sessions=... events=... roundtrip_ok=true invalid_logs=0
derived_mismatches=0 usage_mismatches=0 ...``), stops everything, and exits 0 only when every
check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from dsh_dev.cli.cmd_broker import prepare_stack, role_settings
from dsh_dev.cli.demo_fleet import run_demo_fleet
from dsh_dev.localstack.artifacts import Artifacts, ensure_artifacts
from dsh_dev.localstack.process import free_ports
from dsh_dev.localstack.roundtrip import Record, publish_and_read_back
from dsh_dev.localstack.stack import LocalStack
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.secure.acls import acl_plan
from pipeline.adapters.secure.security import ROLES, SecureSetup
from pipeline.cli.common import add_duration
from pipeline.codec.avro import EventSerde
from pipeline.codec.records import event_headers, record_key
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import ConfigError
from pipeline.core.events import Event
from pipeline.services.dashboard.background import BackgroundDashboard
from pipeline.settings import Settings

# Relative to the current directory: the top of a checkout (--samples DIR for others).
DEFAULT_SAMPLES = Path("samples") / "sessions"


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="run the whole pipeline on a local stack and check it",
        description="Start the local stack (or use DSH_BOOTSTRAP_SERVERS with --external) and "
                    "the dashboard, publish the sample sessions and read them back, run "
                    "scripted agent sessions through the driver and a processors worker, check "
                    "every derived table against the log, print one summary line.")
    parser.add_argument("--external", action="store_true",
                        help="use the broker of DSH_BOOTSTRAP_SERVERS instead of starting one")
    parser.add_argument("--samples", type=Path, default=DEFAULT_SAMPLES, metavar="DIR",
                        help="folder of dsh session files (*.jsonl, *.jsonl.zstd) to publish "
                             "(default: samples/sessions of the current directory: a "
                             "checkout's top)")
    parser.add_argument("--sessions", type=int, default=8, metavar="N",
                        help="scripted agent sessions to run through the driver (0: only "
                             "publish the samples)")
    parser.add_argument("--turns", type=int, default=2, metavar="N",
                        help="turns per scripted session")
    parser.add_argument("--secure", action="store_true",
                        help="run on a secure local stack (TLS, SCRAM, ACLs, registry auth), "
                             "every part as its own principal (docs/security.md)")
    add_duration(parser, "--ready-timeout", default=180.0,
                 help="how long each of Kafka and the registry may take to answer")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.sessions < 0 or args.turns < 1:
        raise ConfigError("--sessions must be 0 or more and --turns 1 or more")
    sessions = load_sessions(args.samples)
    if args.external:
        _progress(f"using the broker at {settings.bootstrap_servers}")
        return _with_dashboard(settings, sessions, args)
    artifacts = Artifacts.default()
    ensure_artifacts(artifacts, with_acl_tool=args.secure, progress=_progress)
    with tempfile.TemporaryDirectory(prefix="dsh-demo-secure-") as run_dir:
        security = SecureSetup.create(Path(run_dir)) if args.secure else None
        stack = LocalStack(artifacts, security=security, acl_rules=acl_plan(settings))
        stack.start(budget_s=args.ready_timeout)
        try:
            _progress(f"local stack ready in {stack.started_s:.1f} s: "
                      f"bootstrap={stack.bootstrap} registry={stack.registry_url}")
            if security is None:
                return _with_dashboard(role_settings(stack, settings, 1), sessions, args)
            prepare_stack(stack, settings, 1)
            roles = {role: role_settings(stack, settings, 1, role) for role in ROLES}
            return _with_dashboard(roles["admin"], sessions, args, roles)
        finally:
            _progress("stopping the local stack ...")
            stack.stop()


def load_sessions(folder: Path) -> dict[str, list[Event]]:
    """Session id -> its events, from every ``*.jsonl`` and ``*.jsonl.zstd`` in ``folder``."""
    files = sorted([*folder.glob("*.jsonl"), *folder.glob("*.jsonl.zstd")])
    if not files:
        raise ConfigError(f"no sample sessions (*.jsonl, *.jsonl.zstd) in {folder.resolve()}: "
                          "run at the top of a checkout of the repository, or give a folder "
                          "of session files with --samples DIR")
    sessions: dict[str, list[Event]] = {}
    for path in files:
        session = read_session_file(path)
        session_id = session.session_id or ""
        if not session_id or "{{" in session_id or session_id in sessions:
            # Some samples carry a template placeholder as id: the file name keeps them apart.
            session_id = path.name.split(".")[0]
        sessions[session_id] = list(session.events)
        _progress(f"read {path.name}: session {session_id}, {len(session.events)} events")
    return sessions


def _with_dashboard(settings: Settings, sessions: dict[str, list[Event]],
                    args: argparse.Namespace, roles: dict[str, Settings] | None = None) -> int:
    """The live dashboard runs while the sessions go through; its URL is printed first.
    ``roles``: each part's own settings (principals on a secure stack), else ``settings``."""
    def role(name: str) -> Settings:
        return (roles or {}).get(name, settings)

    report = asyncio.run(ensure_topics(settings))
    _progress(f"topics: {len(report.created)} created, {len(report.existing)} existing")
    # The fleet's processors worker answers the dashboard's session pages from its tables.
    port = free_ports(1)[0] if args.sessions > 0 else None
    viewer = role("dashboard") if port is None else dataclasses.replace(
        role("dashboard"), dashboard_processors_url=f"http://127.0.0.1:{port}")
    with BackgroundDashboard(viewer, EventSerde().decode) as url:
        _progress(f"dashboard: {url}  (open it to watch the fleet)")
        summary: dict[str, object] = {}
        ok = _roundtrip(role("ingest"), sessions, summary)
        if args.sessions > 0:
            figures = asyncio.run(run_demo_fleet(settings, sessions, sessions=args.sessions,
                                                 turns=args.turns, progress=_progress,
                                                 roles=roles, processors_port=port))
            summary.update(figures)
            ok = ok and all(figures[k] == 0 for k in (
                "invalid_logs", "session_failures", "derived_mismatches", "usage_mismatches"))
    print(" ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                   for k, v in summary.items()), flush=True)
    return 0 if ok else 1


def _roundtrip(settings: Settings, sessions: dict[str, list[Event]],
               summary: dict[str, object]) -> bool:
    serde = EventSerde()
    records = {
        session_id: [Record(record_key(session_id), serde.encode(session_id, event),
                            tuple(event_headers(event))) for event in events]
        for session_id, events in sessions.items()}
    sent = [record for session in records.values() for record in session]
    received = asyncio.run(publish_and_read_back(
        settings, settings.topics.session_events, sent, _progress))
    ok = _same_per_session(records, received)
    summary.update(sessions=len(sessions), events=len(sent), roundtrip_ok=ok)
    return ok


def _same_per_session(sent: dict[str, list[Record]], received: list[Record]) -> bool:
    """Every session's records came back exactly, in order (one partition per session)."""
    by_session: dict[bytes, list[Record]] = {}
    for record in received:
        by_session.setdefault(record.key, []).append(record)
    expected = {records[0].key: records for records in sent.values() if records}
    for key, records in expected.items():
        if by_session.get(key) != records:
            _progress(f"mismatch in session {key.decode('utf-8', 'replace')}: sent "
                      f"{len(records)}, read back {len(by_session.get(key, []))}")
            return False
    return set(by_session) == set(expected)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
