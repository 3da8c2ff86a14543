"""CHAOS.md: what a campaign did and what held, written by ``dsh-pipeline chaos``.

Sections: the run (seed, durations, fleet, command to reproduce); faults by kind and count;
recovery per fault kind (p50/p99 seconds from the end of a fault until the consumer lag of
every group on the inbox and session topic is back under one second, and the drivers'
takeover after a kill); throughput with no fault beside throughput under faults (steps/s and
events/s, counted from the event times of the campaign's sessions); every invariant with its
result; the fault log with wall-clock times.
"""

from __future__ import annotations

import json
import platform
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from dsh_dev.chaos.campaign import Outcome, Phase
from dsh_dev.chaos.invariants import events_of
from dsh_dev.chaos.load import MODELS, PROVIDER

RECOVERED_LAG_S: Final = 1.0
RECOVERY_HORIZON_S: Final = 120.0


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def normal_lag_s(outcome: Outcome) -> float:
    """What "recovered" means: the lag is back under twice the no-fault phase's p90 lag
    (at least :data:`RECOVERED_LAG_S`), since under continuous load it is rarely 0."""
    baseline = next((p for p in outcome.phases if p.name == "baseline"), None)
    quiet = [s for _, wall, s, _ in outcome.lag_samples
             if baseline is not None and baseline.began_ms <= wall < baseline.ended_ms]
    return max(RECOVERED_LAG_S, 2 * (percentile(quiet, 0.9) or 0.0))


def recovery_by_kind(outcome: Outcome) -> dict[str, list[float]]:
    """Seconds from each fault's end to the first lag sample under :func:`normal_lag_s`."""
    faults = outcome.faults
    times: dict[str, list[float]] = defaultdict(list)
    if faults is None:
        return times
    threshold = normal_lag_s(outcome)
    for record in faults.log:
        if not record.ended:
            continue
        for at, _, seconds, _ in outcome.lag_samples:
            if at >= record.ended and at - record.ended <= RECOVERY_HORIZON_S and (
                    seconds <= threshold):
                times[record.kind].append(at - record.ended)
                break
    return times


def throughput(outcome: Outcome, phase: Phase) -> tuple[float, float]:
    """(steps/s, events/s) of the campaign's sessions by event time within ``phase``."""
    if outcome.found is None or phase.ended_ms <= phase.began_ms:
        return 0.0, 0.0
    steps = events = 0
    for session_id in outcome.session_ids:
        for event in events_of(outcome.found, session_id):
            if phase.began_ms <= event.time < phase.ended_ms:
                events += 1
                steps += event.type == "step/end"
    seconds = (phase.ended_ms - phase.began_ms) / 1000
    return steps / seconds, events / seconds


def render(outcome: Outcome, command: str) -> str:
    o = outcome.options
    lines = [
        "# CHAOS.md: the chaos campaign's report", "",
        f"Written by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"({platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}). Result: **{'PASS' if outcome.ok else 'FAIL'}**.", "",
        f"- seed **{o.seed}**, {o.sessions} sessions, {o.rate_per_s:g} inbox commands/s, "
        f"{o.baseline_s:.0f} s without faults then {o.fault_s:.0f} s with faults; store "
        f"`{o.store}`",
        "- fleet: a 3-node Kafka (replication 3, min ISR 2), each broker behind its own "
        "Toxiproxy; 2 drivers, 2 processors workers, the dashboard and a shipper, each a "
        "`dsh-pipeline` subprocess; a local OpenAI-compatible streaming provider",
        f"- {outcome.commands} inbox commands acknowledged ({outcome.unacknowledged} not "
        "acknowledged, left out of the checks)",
        *_ledger_setup(outcome),
        "", *_faults_table(outcome), "", *_recovery_table(outcome), "",
        *_throughput_table(outcome), "", *_invariants(outcome), "", *_exits(outcome), "",
        *_fault_log(outcome), ""]
    return "\n".join(lines)


def _ledger_setup(outcome: Outcome) -> list[str]:
    """What the cost ledger's invariant covers: tenants and prices."""
    if outcome.price_change_ms is None:
        return []
    tenants = sorted(set(outcome.tenants.values()))
    default = len(outcome.session_ids) - len(outcome.tenants)
    stamp = time.strftime("%H:%M:%S", time.gmtime(outcome.price_change_ms / 1000))
    return [f"- cost ledger: {len(outcome.tenants)} sessions in tenants "
            f"{', '.join(f'`{t}`' for t in tenants)}, {default} in the default tenant; "
            f"`DSH_PRICES` prices `{PROVIDER}/{MODELS[0]}` (repriced at {stamp} UTC) and "
            f"`{PROVIDER}/*`, not the shipped sessions' model (unpriced calls)"]


def _faults_table(outcome: Outcome) -> list[str]:
    log = outcome.faults.log if outcome.faults else []
    counts = Counter(r.kind for r in log)
    lines = ["## Faults by kind", "", "| kind | count |", "|---|---:|"]
    lines += [f"| {kind} | {count} |" for kind, count in sorted(counts.items())]
    lines.append(f"| **all** | **{len(log)}** |")
    served = {k: v for k, v in outcome.provider_served.items() if k != "answer"}
    if served:
        lines += ["", "Provider faults actually served (requests answered with the fault): "
                  + ", ".join(f"{k} {v}" for k, v in sorted(served.items())) + "."]
    if outcome.faults and outcome.faults.errors:
        lines += ["", "Faults that could not be applied:", ""]
        lines += [f"- {e}" for e in outcome.faults.errors[:20]]
    return lines


def _recovery_table(outcome: Outcome) -> list[str]:
    times = recovery_by_kind(outcome)
    lines = ["## Recovery", "",
             f"Seconds from the end of a fault (process restarted, node restarted, driver "
             f"resumed, toxic removed, provider window closed, garbage written) until the "
             f"largest lag of the consumer groups on the inbox and session topic is back "
             f"to normal: at most {normal_lag_s(outcome):.1f} s, twice the no-fault phase's "
             f"p90 (at least {RECOVERED_LAG_S:g} s). Sampled every second; under continuous "
             f"load the lag is rarely exactly 0 mid-run (the final check waits for 0). Faults "
             f"overlap, so a recovery time covers every fault still in effect; "
             f"'recovered' counts those back to normal within {RECOVERY_HORIZON_S:.0f} s.",
             "",
             "| fault kind | recovered | p50 s | p99 s |", "|---|---:|---:|---:|"]
    counts = Counter(r.kind for r in (outcome.faults.log if outcome.faults else []))
    for kind in sorted(counts):
        values = times.get(kind, [])
        lines.append(f"| {kind} | {len(values)}/{counts[kind]} | "
                     f"{_fmt(percentile(values, 0.5))} | {_fmt(percentile(values, 0.99))} |")
    takeovers = outcome.faults.takeovers if outcome.faults else []
    lines += ["", f"Driver takeover after a `kill -9` (until the drivers' `/health` lists "
              f"every partition again, none still building): {len(takeovers)} measured, p50 "
              f"{_fmt(percentile(takeovers, 0.5))} s, p99 {_fmt(percentile(takeovers, 0.99))} s."]
    if outcome.lag_zero_s is not None:
        lines.append(f"After the faults stopped, every group reached lag 0 in "
                     f"{outcome.lag_zero_s:.1f} s.")
    return lines


def _throughput_table(outcome: Outcome) -> list[str]:
    lines = ["## Throughput", "", "| phase | seconds | steps/s | events/s |",
             "|---|---:|---:|---:|"]
    for phase in outcome.phases:
        steps, events = throughput(outcome, phase)
        seconds = (phase.ended_ms - phase.began_ms) / 1000
        lines.append(f"| {phase.name} | {seconds:.0f} | {steps:.2f} | {events:.1f} |")
    lines += ["", "Counted from the `time` of the campaign's sessions' events (appended by the "
              "drivers), on a machine shared with the cluster and every service."]
    return lines


def _invariants(outcome: Outcome) -> list[str]:
    lines = ["## Invariants", "", "| invariant | result | detail |", "|---|---|---|"]
    for result in outcome.results:
        lines.append(f"| {result.name} | {'held' if result.ok else '**VIOLATED**'} | "
                     f"{result.summary} |")
    periodic = outcome.periodic
    if periodic:
        held = sum(r.ok for r in periodic)
        lines.append(f"| session logs during the faults (periodic) | "
                     f"{'held' if held == len(periodic) else '**VIOLATED**'} | "
                     f"{held}/{len(periodic)} checks clean |")
    for result in [*outcome.results, *periodic]:
        if result.violations:
            lines += ["", f"### Violated: {result.name}", ""]
            lines += [f"- {v}" for v in result.violations]
        if result.notes:
            lines += ["", f"### Noted (not a violation): {result.name}", ""]
            lines += [f"- {n}" for n in result.notes]
    return lines


def _exits(outcome: Outcome) -> list[str]:
    lines = ["## Services that exited on their own", ""]
    if not outcome.exits:
        return [*lines, "None: every service ran until a fault or the end stopped it."]
    lines += ["A supervisor restarts them within a second (as a process supervisor would); "
              "each exit is a finding, not counted among the invariants.", ""]
    return lines + [f"- {line}" for line in outcome.exits]


def _fault_log(outcome: Outcome) -> list[str]:
    log = outcome.faults.log if outcome.faults else []
    lines = ["## Fault log", "", "| # | wall clock (UTC) | kind | target | lasted s | detail |",
             "|---:|---|---|---|---:|---|"]
    for n, record in enumerate(log, 1):
        stamp = time.strftime("%H:%M:%S", time.gmtime(record.began_wall))
        lasted = f"{record.ended - record.began:.1f}" if record.ended else "-"
        detail = ", ".join(f"{k}={v}" for k, v in record.detail.items())
        lines.append(f"| {n} | {stamp}.{int(record.began_wall * 1000) % 1000:03d} | "
                     f"{record.kind} | {record.target} | {lasted} | {detail} |")
    return lines


def render_seeds(runs: Sequence[tuple[Outcome, str]], planned: int) -> str:
    """The report of ``--seeds``: a row per campaign (seed, result, what failed, the
    command to rerun it), then each campaign's own report one heading level down, under a
    heading that names its seed and result."""
    passed = sum(outcome.ok for outcome, _ in runs)
    lines = ["# CHAOS.md: chaos campaigns with seeds from the clock", "",
             f"{len(runs)} of {planned} campaigns run, {passed} passed "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}).",
             "", "| # | seed | result | invariants violated | faults | rerun |",
             "|---:|---:|---|---|---:|---|"]
    for number, (outcome, command) in enumerate(runs, 1):
        violated = [r.name for r in [*outcome.results, *outcome.periodic] if not r.ok]
        faults = len(outcome.faults.log) if outcome.faults else 0
        lines.append(f"| {number} | {outcome.options.seed} | "
                     f"{'PASS' if outcome.ok else '**FAIL**'} | "
                     f"{'; '.join(violated) or '-'} | {faults} | `{command}` |")
    for number, (outcome, command) in enumerate(runs, 1):
        body = render(outcome, command).splitlines()[1:]   # its own title goes
        lines += ["", f"## Campaign {number}: seed {outcome.options.seed}, "
                      f"{'PASS' if outcome.ok else 'FAIL'}",
                  *(("#" + line) if line.startswith("#") else line for line in body)]
    return "\n".join(lines) + "\n"


def write_seeds_report(runs: Sequence[tuple[Outcome, str]], planned: int, path: Path
                       ) -> None:
    path.write_text(render_seeds(runs, planned), encoding="utf-8")


def write_report(outcome: Outcome, path: Path, command: str) -> None:
    path.write_text(render(outcome, command), encoding="utf-8")


def write_raw(outcome: Outcome, workdir: Path) -> None:
    """The fault log and the lag samples as JSON beside the services' logs (for analysis)."""
    faults = outcome.faults.log if outcome.faults else []
    (workdir / "faults.json").write_text(json.dumps(
        [{"kind": r.kind, "target": r.target, "began_wall": r.began_wall, "began": r.began,
          "ended": r.ended, **r.detail} for r in faults], indent=1), encoding="utf-8")
    (workdir / "lag.json").write_text(json.dumps(
        [{"at": at, "wall_ms": wall, "seconds": s, "records": n}
         for at, wall, s, n in outcome.lag_samples]),
        encoding="utf-8")
