"""Check a running processors worker against core's folds of the same logs (for ``demo``).

For every session: the worker's ``GET /sessions/{id}/messages`` must equal
``core.log.derive_messages`` of the log, and ``GET /usage/sessions/{id}`` must equal the
usage summed over the log (:class:`~pipeline.core.usage.UsageScan`). The worker is polled
until it has folded each whole log (``nextSeq``) or the deadline passes; a session that never
catches up counts as a mismatch. Optionally the per-model totals are checked too (all
sessions on the topic must then be among ``logs``).

Usage from the demo (events published Avro-encoded with ``EventSerde`` and the ``dsh.type`` /
``dsh.seq`` headers; a worker started with ``dsh-pipeline processors --web-port PORT`` and the
same ``DSH_*`` settings)::

    url = f"http://127.0.0.1:{port}"
    await wait_ready(url, timeout_s=90)
    report = await verify_processors(url, logs, timeout_s=60)
    summary.update(report.summary())   # derived_mismatches, usage_mismatches (0 = success)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pipeline.core.errors import TransportError
from pipeline.core.events import Event
from pipeline.core.log import derive_messages
from pipeline.core.usage import TokenCounts, UsageScan

_DSH_KEYS = {"input_tokens": "dsh.usage.input_tokens", "output_tokens": "dsh.usage.output_tokens",
             "cache_read_tokens": "dsh.usage.cache_read_tokens",
             "cache_write_tokens": "dsh.usage.cache_write_tokens",
             "reasoning_tokens": "dsh.usage.reasoning_tokens", "calls": "dsh.usage.calls"}


@dataclass(slots=True)
class VerifyReport:
    """What differed; every count 0 means the processors agree with core."""

    sessions: int = 0
    derived_mismatches: int = 0
    usage_mismatches: int = 0
    model_mismatches: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.derived_mismatches or self.usage_mismatches or self.model_mismatches)

    def summary(self) -> dict[str, int]:
        return {"derived_mismatches": self.derived_mismatches,
                "usage_mismatches": self.usage_mismatches}


async def wait_ready(base_url: str, *, timeout_s: float = 90.0) -> None:
    """Wait until the worker answers ``/health``, owns partitions and is not recovering.

    Raises :class:`TransportError` naming the last state seen when the deadline passes.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(base_url.rstrip("/"), timeout=timeout) as http:
        while time.monotonic() < deadline:
            try:
                status, body = await _get(http, "/health")
            except TransportError as exc:
                last = str(exc)
            else:
                if status == 200 and body["partitions"] and not body["recovery"]["in_recovery"]:
                    return
                last = f"HTTP {status}: {body}"
            await asyncio.sleep(0.3)
    raise TransportError(f"processors worker at {base_url} not ready after {timeout_s:.0f}s: "
                         f"{last}"[:500])


def counts_of_record(record: Mapping[str, Any]) -> TokenCounts:
    """dsh's disjoint counts from an exported usage record."""
    return TokenCounts(**{name: int(record.get(key, 0)) for name, key in _DSH_KEYS.items()})


async def verify_processors(base_url: str, logs: Mapping[str, Sequence[Event]], *,
                            timeout_s: float = 60.0, check_models: bool = False
                            ) -> VerifyReport:
    """Compare the worker at ``base_url`` with core's folds of ``logs`` (session id -> events).

    Raises :class:`TransportError` when the worker cannot be reached at all.
    """
    report = VerifyReport(sessions=len(logs))
    scan = UsageScan()
    deadline = time.monotonic() + timeout_s
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(base_url.rstrip("/"), timeout=timeout) as http:
        for session_id, events in logs.items():
            scan.add_log(session_id, events)
            await _check_session(http, session_id, events, scan, report, deadline)
        if check_models:
            await _check_models(http, scan, report, deadline)
    return report


async def _check_session(http: aiohttp.ClientSession, session_id: str, events: Sequence[Event],
                         scan: UsageScan, report: VerifyReport, deadline: float) -> None:
    next_seq = events[-1].seq + 1 if events else 0
    body = await _caught_up(http, session_id, next_seq, deadline)
    if body is None:
        report.derived_mismatches += 1
        report.usage_mismatches += 1
        report.problems.append(f"{session_id}: worker never reached seq {next_seq - 1}")
        return
    if body["messages"] != list(derive_messages(events)):
        report.derived_mismatches += 1
        report.problems.append(f"{session_id}: derived messages differ from core's derivation")
    status, usage = await _get(http, f"/usage/sessions/{session_id}")
    found = counts_of_record(usage) if status == 200 else TokenCounts()
    if found != scan.by_session[session_id]:
        report.usage_mismatches += 1
        report.problems.append(f"{session_id}: usage {found} != full scan "
                               f"{scan.by_session[session_id]}")


async def _caught_up(http: aiohttp.ClientSession, session_id: str, next_seq: int,
                     deadline: float) -> dict[str, Any] | None:
    while True:
        try:
            status, body = await _get(http, f"/sessions/{session_id}/messages")
        except TransportError:
            if time.monotonic() >= deadline:
                raise
            status, body = 0, None  # not up yet (or restarting): keep polling
        if status == 200 and int(body.get("nextSeq", -1)) >= next_seq:
            return dict(body)
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.2)


async def _check_models(http: aiohttp.ClientSession, scan: UsageScan, report: VerifyReport,
                        deadline: float) -> None:
    """Model totals are folded one stage later (a repartition): poll until equal or deadline."""
    while True:
        _status, body = await _get(http, "/usage/models")
        found = {f"{m['gen_ai.provider.name']}/{m['gen_ai.request.model']}": counts_of_record(m)
                 for m in (body or {}).get("models", [])}
        wrong = [key for key in set(found) | set(scan.by_model)
                 if found.get(key) != scan.by_model.get(key)]
        if not wrong or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.2)
    for key in sorted(wrong):
        report.model_mismatches += 1
        report.problems.append(f"model {key}: {found.get(key)} != full scan "
                               f"{scan.by_model.get(key)}")


async def _get(http: aiohttp.ClientSession, path: str) -> tuple[int, Any]:
    try:
        async with http.get(path) as response:
            if response.content_type != "application/json":
                return response.status, None
            return response.status, await response.json()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TransportError(f"processors worker: GET {path}: "
                             f"{type(exc).__name__}: {exc}") from None
