"""BENCHMARKS.md from the suite's figures."""

from __future__ import annotations

import statistics
import time

from suite_core import Figure, machine

TITLES = {
    "avro": "Avro codec (issue 3)",
    "fold": "Fold cost against session length (issue 3)",
    "memory": "Memory per session",
    "state": "Processors state of one long session (issue 22)",
    "ingest": "Ingest, consume and decode",
    "processors": "Processors worker and end-to-end latency",
    "driver": "Driver (issue 4)",
    "replay": "Replay",
    "otel": "OTLP trace export (issue 18)",
    "scaleout": "Scale-out on a 3-broker cluster (issue 9)",
    "import": "Import of dsh session files (issue 22)",
    "dashboard": "Dashboard ready time against history (issue 22)",
    "browser": "Token -> browser (issue 21)",
    "idle": "Idle CPU (issue 21)",
    "secure": "The secure stack against plaintext (issue 16)",
    "restart": "Processors restart with history (issue 16)",
    "history": "Driver start, memory and wake-up against history (issue 28)",
    "approval": "Approval of a tool call (issue 32)",
    "mcp": "MCP tool calls (issue 32)",
}

NOT_MEASURED = """\
- **Scaling beyond one machine**: two processors workers, and 1-3 drivers in the scale-out
  run, share these 2 cores with each other and with the brokers, so their figures say that the
  work moves and stays correct, not how far it would scale on machines of their own.
- **The driver's memory while turns run**: the figure is the state of idle (recovered)
  sessions; a running turn adds its stream buffers for the duration of a step.
- **The processors' memory inside the faust worker**: the tables are measured as the dicts
  the folding code keeps (the memory store); faust's own per-key overhead and RocksDB are not.
- **Registry framing** (Confluent, schema id lookups): the suite uses single-object framing;
  the codec's cost for both framings is in `bench/bench_avro.py`.
- **Naive fold beyond 1,000 events**: it is quadratic; at 10,000 events one session would
  take minutes, so the naive column stops where the difference is already clear.
- **Cold-disk reads**: consume, replay and their anchors read topics written moments before,
  from the OS page cache, as a live consumer does; reading from disk was not measured.
"""

METHOD = """\
- Each figure is the median of its runs, except a figure whose target must hold in every run
  (latency, idle cost): it is the **worst** of its runs, marked "worst of N" (a latency
  figure runs at least 5 times). *Spread* is min-max over the runs. *Ratio* is ours /
  anchor, the anchor summarised the same way (for latency and cost, lower is better; for
  rates, higher). *met* / *not met* judges that value against the goal.
- Latency goals (issue 33) are multiples of Kafka's `EndToEndLatency` p99 (acks=all, the
  mix's mean record size) measured on the same broker next to each run (interleaved, one
  anchor per run), not absolute times set on another machine: each run has its own ratio,
  listed in the Goal column ("per run"), and the goal is met only when every run's ratio is.
- Broker: one local KRaft node (Kafka 4.4.0, started by the suite unless `--bootstrap`),
  replication factor 1; all producers acks=all and idempotent. A benchmark using the broker
  starts once the broker has used under 10% of a core for 2 s (at most 120 s of waiting), so
  that an earlier benchmark's aftermath (log cleaning, segment deletion) is not its load.
- The realistic mix: `dsh_dev.synth` sessions, whose proportions follow the recorded
  fixtures in `../shared/fixtures` (per turn: claim, 1-4 steps, reasoning runs of 10-30
  deltas, tool-call argument runs of 15-35 pieces, text runs of 1-30 deltas, tool results of
  60-600 chars, a few percent of retries, cancels and compactions: ~87% `assistant/chunk`).
  The Avro codec figure uses the fixtures' recorded events themselves. The processors
  benchmark uses the tests' generated sessions (usage per model, ~70% chunks).
- Anchors: Kafka's `ProducerPerformance` with the same record count, the mean Avro record
  size of the mix, the same partitions, acks=all and the same batch/linger/idempotence as our
  producer, `--throughput -1` (unthrottled, as its documentation says for a throughput test);
  `ConsumerPerformance` reading the same topic (its `fetch.nMsg.sec`, start-up excluded);
  `EndToEndLatency` (one record at a time, acks=all, same record size); a plain aiokafka
  producer sending the same events as JSON with the same settings.
- CPU-time figures (codec, fold) are CPU time of the benchmark process: on a loaded machine
  they are what the code costs, wall-time figures are what it achieved beside its neighbours.
"""


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def _row(figure: Figure, *, judged: bool = True) -> str:
    runs = len(figure.ours)
    spread = (f"{_num(min(figure.ours))}-{_num(max(figure.ours))}" if runs > 1 else "1 run")
    if not figure.ours:
        return f"| {figure.name} | not measured | | | {figure.anchor or '-'} | | | |"
    ratio = figure.ratio
    anchor = figure.anchor or "-"
    if figure.anchor and not figure.anchor_values:
        anchor += " (not measured)"
    value = f"{_num(figure.headline)} {figure.unit}"
    if figure.worst_counts and runs > 1:
        value = f"{value} (worst of {runs})"
    return (f"| {figure.name} | {value} | {spread} | {anchor} | "
            f"{_num(figure.anchor_headline)} | {'-' if ratio is None else f'{ratio:.2f}'} | "
            f"{_goal(figure, judged)} |")


def _goal(figure: Figure, judged: bool) -> str:
    """The goal, and whether this run met it (the figure's value against it) where that is
    known, and each run's ratio where the goal is one; a --quick run's figures are not
    judged."""
    if not figure.goal:
        return "-"
    ratios = _ratios(figure)
    if figure.met is None or not judged:
        return figure.goal + ratios
    return f"{figure.goal}: {'**met**' if figure.met else '**not met**'}{ratios}"


def _ratios(figure: Figure) -> str:
    """'; per run: 2.1x, 3.0x, -' (a run without its anchor: '-'), for a ratio goal."""
    if figure.ratio_limit is None:
        return ""
    per_run = [f"{value / anchor:.2f}x" if anchor > 0 else "-"
               for value, anchor in zip(figure.ours, figure.e2e_p99, strict=False)]
    return f"; per run: {', '.join(per_run) or 'none'}"


def _run_notes(figures: list[Figure]) -> list[str]:
    """Per run, what its probes saw (loop lag, collector pauses, batches), and its anchor."""
    lines = []
    for figure in figures:
        for run, note in enumerate(figure.run_notes, 1):
            anchor = (f"EndToEndLatency p99 {figure.e2e_p99[run - 1]:.1f} ms; "
                      if run <= len(figure.e2e_p99) else "")
            value = f"{_num(figure.ours[run - 1])} {figure.unit}; " if run <= len(
                figure.ours) else ""
            lines.append(f"- {figure.name}, run {run}: {value}{anchor}{note}")
    return lines


ANCHOR_TOOLS = ("ProducerPerformance", "ConsumerPerformance", "EndToEndLatency")


def anchor_header(results: dict[str, list[Figure]]) -> list[str]:
    """This machine's own Kafka figures in the run (Kafka's tools, each with where it was
    measured): what a reader compares first between two runs on two machines."""
    seen: dict[tuple[str, str, tuple[float, ...]], None] = {}
    for name, figures in results.items():
        for figure in figures:
            if figure.anchor_values and any(t in figure.anchor for t in ANCHOR_TOOLS):
                seen[(name, figure.anchor, tuple(figure.anchor_values))] = None
            if (figure.ratio_limit is not None and any(figure.e2e_p99)
                    and figure.e2e_p99 != figure.anchor_values):
                seen[(name, "EndToEndLatency p99 (acks=all), next to each run",
                      tuple(figure.e2e_p99))] = None
    lines = []
    for name, label, values in seen:
        measured = [v for v in values if v > 0]
        if measured:
            lines.append(f"- {label} ({name}): median {_num(statistics.median(measured))}, "
                         f"min-max {_num(min(measured))}-{_num(max(measured))} over "
                         f"{len(measured)} run{'s' if len(measured) != 1 else ''}")
    if not lines:
        return []
    return ["", "## This machine's Kafka (anchors measured in this run)", "",
            "Kafka's own tools on this run's broker, the same machine (ms for latency, "
            "records/s for throughput): latency goals are multiples of EndToEndLatency p99 "
            "measured next to each run, so two machines compare by these first.", "", *lines]


def render(results: dict[str, list[Figure]], failures: dict[str, str], *, command: str,
           quick: bool, elapsed_s: float, load: tuple[str, str]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        "# Benchmarks", "",
        f"Written by `{command}` on {when}, in {elapsed_s / 60:.1f} minutes.", "",
        f"- Machine: {machine()}.",
        f"- Load average (1/5/15 min) before / after the run: {load[0]} / {load[1]} (the "
        "suite's own brokers and scale-out cluster count in it). Nothing keeps other "
        "processes off the machine meanwhile: wall-time figures depend on what else ran, and "
        "ratios to anchors measured in the same run are the comparable numbers.",
    ]
    if quick:
        lines.append("- **--quick run**: every benchmark ran briefly with small sizes; these "
                     "figures show the suite works, not how fast anything is (start-up costs "
                     "dominate the small runs).")
    lines += anchor_header(results)
    lines += ["", "## Method", "", METHOD]
    for name, figures in results.items():
        lines += ["", f"## {TITLES.get(name, name)}", "",
                  "| Figure | Ours | Spread | Anchor | Anchor (same summary) | Ratio | Goal |",
                  "|---|---|---|---|---|---|---|"]
        lines += [_row(figure, judged=not quick) for figure in figures]
        notes = dict.fromkeys(f.note for f in figures if f.note)
        lines += [""] + [f"- {note}" for note in notes] + _run_notes(figures)
    if failures:
        lines += ["", "## Failed in this run", ""]
        lines += [f"- `{name}`: {reason[:500]}" for name, reason in failures.items()]
    lines += ["", "## Not measured, and why", "", NOT_MEASURED]
    return "\n".join(lines).rstrip() + "\n"
