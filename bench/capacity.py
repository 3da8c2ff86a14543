"""deploy/CAPACITY.md from per-core figures: brokers, partitions, drivers and workers for
10,000, 100,000 and 1,000,000 concurrent agent sessions under a stated mix.

    .venv/bin/python bench/capacity.py [--figures bench.jsonl] [--output deploy/CAPACITY.md]

The per-core figures are what ``dsh-pipeline bench`` measures and prints (one JSON line per
figure on stdout; ``make bench`` saves them to ``bench.jsonl``): ``--figures`` reads them
from such a file; without it, the defaults below are the figures of the run named in
:data:`DEFAULTS_FROM`. Everything else (the mix, what a broker can carry) is an assumption,
stated in the output and changeable by flag.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path

NETWORK_CEILING = 0.7  # of a broker's network, leaving room for a failed broker's share
DEFAULTS_FROM = "BENCHMARKS.md of 2026-12-01 and bench_driver_kafka.py runs of the same day"
# figure name prefix in the suite's JSON lines -> the Measured field it sets
FIGURE_NAMES = {
    "Driver over Kafka: events per CPU-second": "driver_events_per_cpu_s",
    "Processors: events per worker CPU-second": "worker_events_per_cpu_s",
    "Memory: driver state per session at 100,000": "driver_bytes_per_session",
    "Memory: processors state per session at 100,000": "worker_bytes_per_session",
    "Replay: events per CPU-second": "rebuild_events_per_cpu_s",
}


@dataclass
class Measured:
    """Per-core figures (the suite measures them)."""

    driver_events_per_cpu_s: float = 24_000.0   # driver + its reader, 1,000 sessions
    worker_events_per_cpu_s: float = 71_398.0
    driver_bytes_per_session: float = 68_705.0
    worker_bytes_per_session: float = 4_428.0
    rebuild_events_per_cpu_s: float = 206_085.0
    record_bytes: float = 130.0                  # mean Avro record of the synthetic mix


@dataclass
class Assumed:
    """The mix and the hardware: assumptions, not measurements."""

    streaming_share: float = 0.2        # sessions streaming a model answer at any moment
    tokens_per_s: float = 50.0          # per streaming session
    tokens_per_chunk: float = 4.0       # provider deltas are a few tokens each
    chunk_share: float = 0.87           # of all events (the fixtures' mix)
    events_per_turn: float = 35.0
    steps_per_turn: float = 2.0
    active_share: float = 0.25          # sessions with a command or turn within the idle evict
    index_bytes_per_session: float = 200.0  # an evicted session's index entry in its driver
    checkpoint_bytes: float = 20_000.0  # a session's checkpoint (its live surface, mostly)
    lifetime_events_per_session: float = 20_000.0  # history each session leaves on the topic
    broker_disk_tb: float = 4.0         # log storage a broker holds
    driver_busy: float = 0.5            # loop utilisation kept for latency (queueing)
    worker_busy: float = 0.7
    driver_memory_gib: float = 4.0
    broker_mb_s: float = 200.0          # in + out a broker sustains (a 10 GbE-class VM)
    replicas_per_broker: float = 4000.0
    txn_per_s_per_broker: float = 5000.0
    replication: int = 3
    readers: float = 3.0                # full reads of the session topic: processors, otel, UI
    derived_factor: float = 0.3         # bytes the processors write per session-topic byte
    topics: int = 10                    # inbox, session events, derived and compacted topics
    linger_ms: float = 25.0             # the driver's commit timer
    takeover_read_mb_s: float = 100.0   # checkpoint bytes a takeover reads per second
    takeover_budget_s: float = 2.0      # a moved partition's checkpoints read within this


@dataclass
class Plan:
    sessions: int
    events_per_s: float
    steps_per_s: float
    drivers: int
    workers: int
    partitions: int
    brokers: int
    loads: dict[str, float]  # limit -> share of its ceiling used (1.0 = at the ceiling)

    @property
    def binding(self) -> str:
        return max(self.loads, key=self.loads.__getitem__)


def plan(sessions: int, m: Measured, a: Assumed) -> Plan:
    chunks_per_s = sessions * a.streaming_share * a.tokens_per_s / a.tokens_per_chunk
    events_per_s = chunks_per_s / a.chunk_share
    driver_cores = events_per_s / m.driver_events_per_cpu_s
    memory = sessions * (a.active_share * m.driver_bytes_per_session
                         + a.index_bytes_per_session)
    by_memory = memory / (a.driver_memory_gib * 2**30)
    drivers = max(2, math.ceil(max(driver_cores / a.driver_busy, by_memory)))
    workers = max(2, math.ceil(events_per_s / m.worker_events_per_cpu_s / a.worker_busy))
    per_partition_bytes = a.takeover_budget_s * a.takeover_read_mb_s * 1e6
    by_takeover = sessions * a.checkpoint_bytes / per_partition_bytes
    partitions = _round_up(max(2 * drivers, 2 * workers, by_takeover, 6))
    in_bytes = events_per_s * m.record_bytes * (1 + a.derived_factor)
    cluster_bytes = in_bytes * (1 + 2 * (a.replication - 1)) + events_per_s * m.record_bytes * (
        a.readers)
    txn_per_s = partitions * 1000 / a.linger_ms
    replicas = partitions * a.topics * a.replication
    history_bytes = (sessions * a.lifetime_events_per_session * m.record_bytes
                     * a.replication)
    brokers = max(a.replication, math.ceil(cluster_bytes / (a.broker_mb_s * 1e6) / NETWORK_CEILING),
                  math.ceil(replicas / a.replicas_per_broker),
                  math.ceil(txn_per_s / a.txn_per_s_per_broker),
                  math.ceil(history_bytes / (a.broker_disk_tb * 1e12)))
    loads = {  # each as a share of its ceiling (the utilisation a plan allows it)
        "broker network": cluster_bytes / (brokers * a.broker_mb_s * 1e6) / NETWORK_CEILING,
        "partitions per broker": replicas / (brokers * a.replicas_per_broker),
        "transactions per broker": txn_per_s / (brokers * a.txn_per_s_per_broker),
        "driver event loop": driver_cores / drivers / a.driver_busy,
        "driver memory": memory / (drivers * a.driver_memory_gib * 2**30),
        "processors CPU": events_per_s / m.worker_events_per_cpu_s / workers / a.worker_busy,
        "takeover after a move": by_takeover / partitions,
        "broker disk (lifetime history)": history_bytes / (brokers * a.broker_disk_tb * 1e12),
    }
    return Plan(sessions, events_per_s, events_per_s * a.steps_per_turn / a.events_per_turn,
                drivers, workers, partitions, brokers, loads)


def _round_up(value: float) -> int:
    """Partitions in steps that divide evenly among many group sizes (multiples of 12)."""
    return int(math.ceil(value / 12) * 12)


def load_figures(path: Path, m: Measured) -> list[str]:
    """Set ``m``'s fields from the suite's JSON lines; returns what was taken."""
    taken = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        for prefix, name in FIGURE_NAMES.items():
            if str(row.get("figure", "")).startswith(prefix) and row.get("ours"):
                value = min(row["ours"]) if name.endswith("cpu_s") else max(row["ours"])
                setattr(m, name, float(value))
                taken.append(f"{name} = {value:,.0f} ({row['figure']})")
    return taken


WHAT_THE_DESIGN_DOES = {
    "broker network": "add brokers: the session topic's partitions spread over them; readers "
                      "that only need changes read the compacted derived topics, not the "
                      "session topic",
    "partitions per broker": "add brokers, or fewer derived topics per session partition; "
                             "partitions are sized to drivers and workers, not to sessions",
    "transactions per broker": "a longer commit timer (--linger) batches more steps per "
                               "transaction; each driver partition commits at most once per "
                               "linger",
    "driver event loop": "add driver processes (one loop each): inbox partitions move between "
                         "them by the consumer group; a moved partition's busy sessions load "
                         "from their checkpoints",
    "driver memory": "sessions idle for `DSH_DRIVER_IDLE_EVICT` leave memory and load from "
                     "their checkpoint on their next command (docs/driver-state.md): memory is "
                     "the active sessions' state plus an index entry per session; a shorter "
                     "idle time lowers the active share",
    "processors CPU": "add workers to the processors group (one partition each at most)",
    "record-size limits": "not a count: a record is ~130 bytes on average, and content "
                          "above the one max record size spills (dsh's spill policy) instead "
                          "of failing; it bounds the largest tool output, not the fleet",
    "takeover after a move": "more partitions: a takeover reads its partition's checkpoints "
                             "(one per session, never the session topic), so fewer sessions "
                             "per partition read faster",
    "broker disk (lifetime history)": "add brokers or disk, or tiered storage for the session "
                                      "topic: the driver and the readers start from "
                                      "checkpoints and compacted outputs, so old segments are "
                                      "read only by replays",
}


def _nearest(p: Plan) -> str:
    first, second = sorted(p.loads, key=p.loads.__getitem__, reverse=True)[:2]
    return f"{first} ({p.loads[first]:.0%}); next {second} ({p.loads[second]:.0%})"


def render(plans: list[Plan], m: Measured, a: Assumed, taken: list[str]) -> str:
    out = ["# Capacity", "",
           "Generated by `bench/capacity.py` (re-run it with `--figures` on the JSON lines "
           "that `make bench` prints, or change an assumption by its flag). Per-core figures "
           "are measurements; the mix and the hardware are assumptions.", "",
           "## Sizes", "",
           "| Sessions | Events/s | Steps/s | Drivers | Workers | Partitions | Brokers | "
           "Binds first |", "|---|---|---|---|---|---|---|---|"]
    for p in plans:
        out.append(f"| {p.sessions:,} | {p.events_per_s:,.0f} | {p.steps_per_s:,.0f} | "
                   f"{p.drivers:,} | {p.workers:,} | {p.partitions:,} | {p.brokers:,} | "
                   f"{_nearest(p)} |")
    out += ["", "## Every limit at each size, as a share of its ceiling", "",
            "Ceilings: the driver loop at `--driver-busy`, processors at `--worker-busy`, "
            f"broker network at {NETWORK_CEILING:.0%}, the rest at 100% of the assumed "
            "figure. Sizes below the minimum counts (2 drivers, 2 workers, 3 brokers) leave "
            "slack; the limit nearest its ceiling binds first as sessions grow.", "",
            "| Limit | " + " | ".join(f"{p.sessions:,}" for p in plans) + " |",
            "|---|" + "---|" * len(plans)]
    for limit in plans[0].loads:
        out.append(f"| {limit} | " + " | ".join(f"{p.loads[limit]:.0%}" for p in plans) + " |")
    out += ["", "## What the design does when a limit binds", ""]
    out += [f"- **{limit}**: {text}." for limit, text in WHAT_THE_DESIGN_DOES.items()]
    out += ["", "## Caveats", "",
            "- The driver's events per CPU-second is measured with 1,000 sessions on one "
            "loop; its latency at that load did not meet 150 ms p99 on the 2-core machine "
            "it was measured on (docs/decisions/driver-latency.md). The loop utilisation "
            "ceiling (`--driver-busy`) is what keeps queueing on the loop short; lower it "
            "for a tighter latency goal, and the driver count grows in proportion.",
            "- Broker figures (network, partitions, transactions per broker) are assumptions "
            "for a mid-size cloud VM, not measured here: the suite runs one broker on the "
            "same 2 cores as everything else.",
            "- A driver keeps in memory the sessions active within the idle eviction time "
            "(`--active-share` of them, each at the measured state per session) and an index "
            "entry for every other session of its partitions; the session topic's lifetime "
            "history no longer enters any driver or reader's start, only broker disk."]
    out += ["", "## Per-core figures (measured)", ""]
    out += [f"- `{f.name}` = {getattr(m, f.name):,.0f}" for f in fields(m)]
    out += [f"- from: {', '.join(taken) if taken else DEFAULTS_FROM}", "",
            "## Assumptions", ""]
    out += [f"- `--{f.name.replace('_', '-')}` = {getattr(a, f.name)}" for f in fields(a)]
    out += ["", "## How it is computed", "",
            "- events/s = sessions x streaming share x tokens/s / tokens per chunk / chunk "
            "share; steps/s = events/s x steps per turn / events per turn.",
            "- drivers = driver CPU (events/s over the driver's events per CPU-second) at "
            "the stated loop utilisation, or memory (active sessions' state plus every "
            "session's index entry), whichever needs more; at least 2.",
            "- workers = events/s over the worker's events per CPU-second at the stated "
            "utilisation; at least 2.",
            "- partitions (per topic) = twice the larger group, or enough that a moved "
            "partition's checkpoints are read within the takeover budget; a multiple of 12.",
            "- brokers = the most of: the replication factor; cluster traffic (writes, "
            "replication, the readers' reads) at 70% of a broker's network; partition "
            "replicas per broker; transaction commits (one per partition per linger) per "
            "broker; the sessions' lifetime history, replicated, on broker disk.", ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--figures", type=Path, help="JSON lines printed by dsh-pipeline bench")
    parser.add_argument("--output", type=Path, help="write Markdown here (else stdout)")
    parser.add_argument("--print-figures", action="store_true",
                        help="print the per-core figures used (stderr)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    for f in fields(Assumed):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default),
                            default=f.default)
    args = parser.parse_args()
    measured = Measured()
    taken = load_figures(args.figures, measured) if args.figures else []
    assumed = Assumed(**{f.name: getattr(args, f.name) for f in fields(Assumed)})
    if args.print_figures:
        for f in fields(measured):
            print(f"capacity: {f.name} = {getattr(measured, f.name):,.0f}", file=sys.stderr)
    text = render([plan(n, measured, assumed) for n in args.sessions], measured, assumed, taken)
    if args.output:
        args.output.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
