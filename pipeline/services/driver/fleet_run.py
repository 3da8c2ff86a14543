"""Run a fleet of sessions end to end through the Kafka driver (for the demo and benchmarks).

:func:`run_fleet` starts one in-process :class:`DriverService`, puts ``turns`` follow-ups per
session on the inbox, follows the session topic (read committed) until every session has
ended that many turns, stops the driver gracefully and checks every log in strict mode.
The summary is one JSON-able dict ``{"sessions", "events", "turns", "steps",
"invalid_logs", "session_failures", "dead_letters", "elapsed_s", ...}``: a demo exits non-zero
when ``invalid_logs`` or ``session_failures`` is not 0 (a runner's invariant check, "the model
request equals the derived messages", fails its session loudly and is counted there).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pipeline.adapters.kafka.event_stream import EventStream, Start
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.core.errors import DshError, TransportError
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.log import SessionLog
from pipeline.services.driver.partition import PartitionContext
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.settings import Settings

Progress = Callable[[str], None]


@dataclass(slots=True)
class FleetRunResult:
    """What a fleet run produced: every session's events, and the counts."""

    logs: dict[str, list[Event]] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)  # session -> why
    metrics: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def summary(self) -> dict[str, object]:
        events = [e for log in self.logs.values() for e in log]
        return {
            "sessions": len(self.logs), "events": len(events),
            "turns": sum(1 for e in events if e.type == "turn/end"),
            "steps": sum(1 for e in events if e.type == "step/end"),
            "invalid_logs": len(self.invalid),
            "session_failures": self.metrics.get("session_failures", 0),
            "dead_letters": self.metrics.get("dead_letters", 0),
            "transactions": self.metrics.get("transactions", 0),
            "elapsed_s": round(self.elapsed_s, 3),
        }


def followups(session_ids: list[str], turns: int, text: Callable[[str, int], str], *,
              tenants: Mapping[str, str] | None = None) -> list[FollowUp]:
    """``turns`` follow-ups per session, round by round (so sessions run side by side);
    ``tenants``: a session's tenant, stated by each of its follow-ups."""
    return [FollowUp(s, f"{s}-m{n}", ({"type": "text", "text": text(s, n)},),
                     tenant=(tenants or {}).get(s)) for n in range(turns) for s in session_ids]


async def run_fleet(ctx: PartitionContext, commands: list[FollowUp], *,
                    encode_command: Callable[[FollowUp], bytes],
                    config: DriverConfig | None = None, timeout_s: float = 300.0,
                    progress: Progress | None = None,
                    sender: Settings | None = None) -> FleetRunResult:
    """Drive ``commands`` through a driver and collect the resulting logs (see module doc).
    ``sender``: the settings that post the commands (default the driver's; on a secure stack
    another principal's, the driver may only read the inbox)."""
    settings = sender or ctx.settings
    expected: dict[str, int] = {}
    for command in commands:
        expected[command.session_id] = expected.get(command.session_id, 0) + 1
    service = DriverService(ctx, config)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    result = FleetRunResult()
    try:
        await asyncio.wait_for(service.ready.wait(), 60)
        started = time.perf_counter()
        await send_records(settings, [
            OutRecord(settings.topics.inbox, c.session_id.encode(), encode_command(c))
            for c in commands])
        await asyncio.wait_for(_collect(ctx, service, expected, result, progress), timeout_s)
        result.elapsed_s = time.perf_counter() - started
    except TimeoutError:
        raise TransportError(f"the fleet run did not finish within {timeout_s:.0f}s") from None
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        result.metrics = service.metrics_snapshot()
    _validate(result)
    return result


async def _collect(ctx: PartitionContext, service: DriverService, expected: dict[str, int],
                   result: FleetRunResult, progress: Progress | None) -> None:
    ended: dict[str, int] = dict.fromkeys(expected, 0)
    waiting = {s for s, n in expected.items() if n > 0}
    async with EventStream(ctx.settings, decode=ctx.decode_event,
                           start=Start.BEGINNING) as stream:
        async for record in stream:
            result.logs.setdefault(record.session_id, []).append(record.event)
            if record.event.type != "turn/end" or record.session_id not in waiting:
                continue
            ended[record.session_id] += 1
            if ended[record.session_id] >= expected[record.session_id]:
                waiting.discard(record.session_id)
                if progress is not None:
                    progress(f"{len(expected) - len(waiting)}/{len(expected)} sessions done")
            if not waiting or service.metrics.session_failures:
                return


def _validate(result: FleetRunResult) -> None:
    for session_id, events in result.logs.items():
        try:
            SessionLog.from_events(session_id, events, mode="strict")
        except DshError as exc:
            result.invalid[session_id] = str(exc)
