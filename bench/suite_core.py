"""The benchmark suite's shared parts: what a benchmark returns, the run context, statistics.

A benchmark is a function ``(Context) -> list[Figure]``; it repeats its measurement
``ctx.runs`` times itself (set-up shared between runs is built once, outside the timed part)
and returns one :class:`Figure` per figure, each with our values and, where there is one, the
anchor's values measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from processes import cpu_seconds

from pipeline.settings import Settings

BENCH_DIR = Path(__file__).resolve().parent
CHECKOUT = BENCH_DIR.parent
FIXTURES = Path(os.environ.get("DSH_FIXTURES_DIR")
                or Path(__file__).resolve().parents[2] / "shared" / "fixtures")

LATENCY_RUNS = 5
# A benchmark using the broker starts once the broker has used under this share of one core
# over a window, waiting at most the budget: an earlier benchmark's aftermath (the log
# cleaner on its compacted topics, segment deletion, group expiry) is not the next one's load.
QUIET_SHARE = 0.10
QUIET_WINDOW_S = 2.0
QUIET_BUDGET_S = 120.0


@dataclass(slots=True)
class Figure:
    """One figure: our values over the runs, and the anchor's (same run, same machine)."""

    name: str
    unit: str
    ours: list[float]
    anchor: str = ""
    anchor_values: list[float] = field(default_factory=list)
    higher_is_better: bool = True
    goal: str = ""
    note: str = ""
    met: bool | None = None  # whether the goal is met, where the benchmark can tell
    # A latency target must hold in every run: such a figure is its worst run, not its median.
    worst_counts: bool = False
    # Issue 33: Kafka's EndToEndLatency p99 (acks=all) measured next to each run, one per
    # value of ``ours``; a target as a multiple of it (``judge_ratios``) holds in every run.
    e2e_p99: list[float] = field(default_factory=list)
    ratio_limit: float | None = None
    run_notes: list[str] = field(default_factory=list)  # per run: what its probes saw

    @property
    def median(self) -> float:
        return statistics.median(self.ours)

    @property
    def headline(self) -> float:
        """The figure's value: the worst run where ``worst_counts``, else the median."""
        return self._summary(self.ours)

    @property
    def anchor_headline(self) -> float | None:
        return self._summary(self.anchor_values) if self.anchor_values else None

    def _summary(self, values: list[float]) -> float:
        if not self.worst_counts:
            return statistics.median(values)
        return max(values) if not self.higher_is_better else min(values)

    @property
    def anchor_median(self) -> float | None:
        return statistics.median(self.anchor_values) if self.anchor_values else None

    @property
    def ratio(self) -> float | None:
        """ours / anchor, each summarised alike (for both kinds of figure: the reader knows
        which way is better)."""
        anchor = self.anchor_headline
        if anchor is None or anchor == 0:
            return None
        return self.headline / anchor

    @property
    def run_ratios(self) -> list[float]:
        """ours / EndToEndLatency p99, run by run (a run without its anchor has none)."""
        return [value / anchor for value, anchor in zip(self.ours, self.e2e_p99, strict=False)
                if anchor > 0]

    def judge_ratios(self, limit: float) -> None:
        """Sets ``met``: every run's value at most ``limit`` times that run's EndToEndLatency
        p99; a run whose anchor is missing fails the target (nothing to compare it with)."""
        self.ratio_limit = limit
        ratios = self.run_ratios
        self.met = bool(ratios) and len(ratios) == len(self.ours) and max(ratios) <= limit

    def judge(self, threshold: float) -> None:
        """Sets ``met``: the headline (the worst run where that counts) against the goal's
        threshold, in the figure's direction."""
        value = self.headline
        self.met = value >= threshold if self.higher_is_better else value <= threshold


@dataclass(slots=True)
class Context:
    """What every benchmark gets: the broker, the size of the run, where to say progress."""

    bootstrap: str
    quick: bool
    runs: int
    tools_lib: Path | None
    log: Callable[[str], None]
    broker_pids: tuple[int, ...] = ()  # the broker's processes when the suite started it
    cluster: str = ""  # a 3-node cluster given for the scale-out benchmark (``--cluster``)

    @property
    def latency_runs(self) -> int:
        """Runs of a latency figure: at least 5 (its worst run is the figure), 1 when quick."""
        return 1 if self.quick else max(self.runs, LATENCY_RUNS)

    def size(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def settings(self, partitions: int = 6) -> Settings:
        """Settings on fresh topics (a unique prefix), so no run reads another's records."""
        prefix = f"bench{uuid.uuid4().hex[:10]}."
        return Settings.from_env({}, bootstrap_servers=self.bootstrap, topic_prefix=prefix,
                                 partitions=partitions, replication_factor=1,
                                 group_id_prefix=f"{prefix}g-")


def wait_quiet(pids: tuple[int, ...], budget_s: float = QUIET_BUDGET_S) -> str:
    """Wait until processes ``pids`` together use under QUIET_SHARE of a core over
    QUIET_WINDOW_S, at most ``budget_s``; returns what was seen, for the log."""
    started = time.monotonic()
    while True:
        before = sum(cpu_seconds(pid) for pid in pids)
        time.sleep(QUIET_WINDOW_S)
        share = (sum(cpu_seconds(pid) for pid in pids) - before) / QUIET_WINDOW_S
        waited = time.monotonic() - started
        if share < QUIET_SHARE:
            return f"broker quiet ({share:.0%} of a core) after {waited:.0f} s"
        if waited >= budget_s:
            return f"broker still busy ({share:.0%} of a core) after {waited:.0f} s; going on"


@contextlib.contextmanager
def kafka_for(bootstrap: str | None) -> Iterator[str]:
    """``bootstrap`` when given, else the address of a single-node Kafka started here for the
    block (in a temporary folder, removed after)."""
    if bootstrap:
        yield bootstrap
        return
    from dsh_dev.localstack.artifacts import Artifacts
    from dsh_dev.localstack.kafka import KafkaLocal
    kafka = KafkaLocal(Artifacts.default().require_kafka(), heap_mb=1024)
    kafka.start(300)
    try:
        yield kafka.bootstrap
    finally:
        kafka.stop()


def json_lines_of_child(script: str, arguments: list[str], *, timeout_s: float = 3600.0
                        ) -> list[dict[str, float]]:
    """Run ``bench/<script>`` in a process of its own; the JSON objects it printed, one per
    line. A failed run raises, with the end of its stderr."""
    done = subprocess.run([sys.executable, str(BENCH_DIR / script), *arguments],
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{script} exited with {done.returncode}: {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; raises on an empty list."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ab_arguments(description: str) -> argparse.ArgumentParser:
    """The options of an A/B benchmark run against other checkouts of the code."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", nargs="*", type=Path, default=[], metavar="CHECKOUT",
                        help="other checkouts of the code, each run in turn with this one")
    return parser


def cpu_and_wall() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def machine() -> str:
    """Cores and memory of this machine (Linux /proc; 'unknown' elsewhere)."""
    cores = os.cpu_count() or 0
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        total_kb = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1])
        memory = f"{total_kb / 1024 / 1024:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        memory = "unknown memory"
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cores} cores ({model}), {memory}"
