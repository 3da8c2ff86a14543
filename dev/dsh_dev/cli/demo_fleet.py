"""The demo's fleet: scripted agent sessions through the Kafka driver, checked by processors.

Run by ``dsh-pipeline demo`` after the sample sessions are published: a processors worker
starts as a child process (``dsh-pipeline processors`` with the same ``DSH_*`` settings),
``--sessions N`` scripted sessions run ``--turns`` two-step tool turns each through an
in-process driver (inbox -> turns -> transactional appends), and then every session, the
samples included, is checked against the worker: its derived messages must equal core's
derivation of the log and its usage the sums over the log.

The scripted sessions belong to three tenants (:data:`DEMO_TENANTS`, the default one
included) and, unless ``DSH_PRICES`` is set, the worker prices the scripted model with
:data:`DEMO_PRICES`, so the dashboard's usage by tenant shows a cost (docs/costs.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dsh_dev.localstack.process import ChildProcess, free_ports
from pipeline.cli.cmd_driver import SCRIPTS, driver_context
from pipeline.codec.inbox import InboxCodec
from pipeline.core.events import Event
from pipeline.services.driver.fleet_run import followups, run_fleet
from pipeline.services.driver.tools import builtin_registry
from pipeline.services.processors.verify import verify_processors, wait_ready
from pipeline.settings import Settings

Progress = Callable[[str], None]
DEMO_TENANTS = ("acme", "globex", "")
# Made-up prices per million tokens for the scripted model: the demo's ledger has a cost.
DEMO_PRICES = json.dumps({"scripted/*": {"from": "2020-01-01", "input": "0.50",
                                         "cached_input": "0.05", "output": "1.50"}})


def start_processors(settings: Settings, port: int, log_path: Path, *,
                     extra: Sequence[str] = (), name: str = "processors worker"
                     ) -> ChildProcess:
    """A processors worker as a child process in its own group (it dies with the demo),
    logging to ``log_path``: faust's start-up is chatty and would bury the progress lines.
    ``extra``: more ``dsh-pipeline processors`` options (the scale-out run's session timeout).
    """
    command = [sys.executable, "-m", "pipeline.cli.main", "processors", "--web-port", str(port),
               "--loglevel", "warning", *extra]
    return ChildProcess(name, command, log_path, Path.cwd(),
                        env={**os.environ, **settings.to_env()})


def _priced(settings: Settings) -> Settings:
    """``settings`` with the demo's prices unless ``DSH_PRICES`` gives a table."""
    return settings if settings.prices else dataclasses.replace(settings, prices=DEMO_PRICES)


def turn_text(session_id: str, turn: int) -> str:
    """The follow-up text of a scripted session's turn (the tool-loop script calls echo)."""
    return f"Turn {turn + 1} of {session_id}: call the echo tool, then summarise."


async def run_demo_fleet(settings: Settings, sample_logs: Mapping[str, Sequence[Event]], *,
                         sessions: int, turns: int, progress: Progress,
                         roles: Mapping[str, Settings] | None = None,
                         processors_port: int | None = None) -> dict[str, object]:
    """Run the fleet, verify everything, return the summary's figures. ``roles``: each
    role's settings (its own principal on a secure stack); missing roles use ``settings``.
    ``processors_port``: the worker's web port (default: a free one)."""
    def role(name: str) -> Settings:
        return (roles or {}).get(name, settings)

    port = processors_port or free_ports(1)[0]
    log_path = Path(settings.state_dir) / "demo-processors.log"
    worker = start_processors(_priced(role("processors")), port, log_path)
    progress(f"processors worker starting (log: {log_path})")
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, timeout_s=180)
        progress(f"processors worker ready at {url}")
        run_id = secrets.token_hex(3)
        ids = [f"demo-{run_id}-{n:04d}" for n in range(sessions)]
        ctx = driver_context(role("driver"), group_id=f"{settings.group_id_prefix}demo-driver",
                             tools=builtin_registry(),
                             script=SCRIPTS["tool-loop"])
        progress(f"running {sessions} scripted sessions x {turns} turns through the driver ...")
        tenants = {s: DEMO_TENANTS[n % len(DEMO_TENANTS)] for n, s in enumerate(ids)}
        result = await run_fleet(ctx, followups(ids, turns, turn_text, tenants=tenants),
                                 encode_command=InboxCodec().encode, progress=progress,
                                 sender=role("ingest"))
        fleet_logs = {s: result.logs.get(s, []) for s in ids}
        logs = {**{s: list(e) for s, e in sample_logs.items()}, **fleet_logs}
        progress(f"verifying {len(logs)} sessions against the processors ...")
        report = await verify_processors(url, logs, timeout_s=180)
        for problem in report.problems[:20]:
            progress(f"mismatch: {problem}")
        fleet_events = [e for log in fleet_logs.values() for e in log]
        return {
            "fleet_sessions": len(ids), "fleet_events": len(fleet_events),
            "turns": sum(1 for e in fleet_events if e.type == "turn/end"),
            "steps": sum(1 for e in fleet_events if e.type == "step/end"),
            "invalid_logs": len(set(result.invalid) & set(ids)),
            "session_failures": result.metrics.get("session_failures", 0),
            **report.summary(),
        }
    finally:
        worker.stop(30)
