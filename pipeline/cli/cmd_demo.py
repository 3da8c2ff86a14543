"""``dsh-pipeline demo``: the sample sessions through a real Kafka and back.

First version (the driver and processors are wired in later): starts the local stack
in-process (or uses ``DSH_BOOTSTRAP_SERVERS`` with ``--external``), ensures the project's
topics, publishes every event of the sample sessions (``<fixtures>/dsh-format0/*.jsonl``) to
the session-events topic as raw JSON keyed by session id, with the type and seq headers,
reads exactly those records back, checks each session's events come back complete, in order
and byte for byte, prints ``sessions=N events=M roundtrip_ok=true|false`` and stops the
stack. Exit 0 only when the round trip is exact.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.localstack.artifacts import CHECKOUT_ROOT, Artifacts, ensure_artifacts
from pipeline.adapters.localstack.roundtrip import Record, publish_and_read_back
from pipeline.adapters.localstack.stack import LocalStack
from pipeline.codec.avro import EventSerde
from pipeline.codec.records import event_headers, record_key
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import ConfigError
from pipeline.services.dashboard.background import BackgroundDashboard
from pipeline.settings import Settings

DEFAULT_FIXTURES = CHECKOUT_ROOT.parent / "shared" / "fixtures"


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="publish the sample sessions through Kafka and read them back",
        description="Start the local stack, publish the sample dsh sessions, read them back.")
    parser.add_argument("--external", action="store_true",
                        help="use the broker of DSH_BOOTSTRAP_SERVERS instead of starting one")
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES, metavar="DIR",
                        help="folder holding dsh-format0/*.jsonl (default: ../shared/fixtures "
                             "beside the checkout)")
    parser.add_argument("--ready-timeout", type=float, default=180.0, metavar="S",
                        help="seconds each of Kafka and the registry may take to answer (180)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    sessions = load_sessions(args.fixtures)
    if args.external:
        _progress(f"using the broker at {settings.bootstrap_servers}")
        return _with_dashboard(settings, sessions)
    artifacts = Artifacts.default()
    ensure_artifacts(artifacts, progress=_progress)
    stack = LocalStack(artifacts)
    stack.start(budget_s=args.ready_timeout)
    try:
        _progress(f"local stack ready in {stack.started_s:.1f} s: bootstrap={stack.bootstrap} "
                  f"registry={stack.registry_url}")
        local = replace(settings, bootstrap_servers=stack.bootstrap,
                        registry_url=stack.registry_url, replication_factor=1)
        return _with_dashboard(local, sessions)
    finally:
        _progress("stopping the local stack ...")
        stack.stop()


def load_sessions(fixtures: Path) -> dict[str, list[Record]]:
    """Session id -> its event records, from every ``dsh-format0/*.jsonl`` under ``fixtures``."""
    files = sorted((fixtures / "dsh-format0").glob("*.jsonl"))
    if not files:
        raise ConfigError(f"no sample sessions in {fixtures / 'dsh-format0'}: give the "
                          "fixtures folder with --fixtures DIR")
    sessions: dict[str, list[Record]] = {}
    for path in files:
        session = read_session_file(path)
        session_id = session.session_id or ""
        if not session_id or "{{" in session_id or session_id in sessions:
            # Some samples carry a template placeholder as id: the file name keeps them apart.
            session_id = path.stem
        key = record_key(session_id)
        sessions[session_id] = [
            Record(key, event.to_line().encode("utf-8"), tuple(event_headers(event)))
            for event in session.events
        ]
        _progress(f"read {path.name}: session {session_id}, {len(session.events)} events")
    return sessions


def _with_dashboard(settings: Settings, sessions: dict[str, list[Record]]) -> int:
    """The live dashboard runs while the sessions go through; its URL is printed first."""
    with BackgroundDashboard(settings, EventSerde().decode) as url:
        _progress(f"dashboard: {url}  (open it to watch the fleet)")
        return _roundtrip(settings, sessions)


def _roundtrip(settings: Settings, sessions: dict[str, list[Record]]) -> int:
    report = asyncio.run(ensure_topics(settings))
    _progress(f"topics: {len(report.created)} created, {len(report.existing)} existing")
    sent = [record for records in sessions.values() for record in records]
    received = asyncio.run(publish_and_read_back(
        settings, settings.topics.session_events, sent, _progress))
    ok = _same_per_session(sessions, received)
    print(f"sessions={len(sessions)} events={len(sent)} roundtrip_ok={str(ok).lower()}",
          flush=True)
    return 0 if ok else 1


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
