"""Latency targets as ratios to Kafka's own latency (issue 33).

A latency target set on one machine does not travel to another: a slower machine (or a busier
one) slows Kafka as much as us. So a latency figure is judged against Kafka's
``EndToEndLatency`` p99 (acks=all, one record at a time, the mix's mean Avro record size)
measured next to each of its runs, on the same broker: each run has its own ratio, and a
target is met only when every run's ratio is. :func:`kafka_e2e` measures that anchor;
:func:`log_ratio` says each run's ratio; :func:`probe_text` formats what the loop-lag and
collector probe (:mod:`pipeline.adapters.loop_probe`) saw in a run.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Mapping

from suite_core import Context, Figure
from suite_kafka import fresh_topic, mean_avro_size, synth_mix
from suite_tools import ToolError, end_to_end_latency

from pipeline.settings import Settings

E2E_LABEL = "EndToEndLatency p99 (acks=all), measured next to each run"


@functools.cache
def record_size(quick: bool) -> int:
    """The mix's mean Avro record size, the anchor's record size."""
    return mean_avro_size(list(synth_mix(3_000 if quick else 100_000)))


def kafka_e2e(ctx: Context) -> tuple[float, float] | None:
    """(p50, p99) ms of EndToEndLatency on a fresh one-partition topic of this broker, or
    None (logged) when the tools are missing or it failed."""
    if ctx.tools_lib is None:
        return None
    prefix = f"bench{uuid.uuid4().hex[:10]}."
    topic = f"{prefix}e2e-anchor"
    single = Settings.from_env({}, bootstrap_servers=ctx.bootstrap, partitions=1,
                               topic_prefix=prefix)
    asyncio.run(fresh_topic(single, topic))
    try:
        p50, p99 = end_to_end_latency(ctx.tools_lib, ctx.bootstrap, topic,
                                      ctx.size(1000, 100), record_size(ctx.quick))
    except ToolError as exc:
        ctx.log(f"anchor failed: {exc}")
        return None
    ctx.log(f"  EndToEndLatency (acks=all) next to this run, p50/p99: {p50:.1f}/{p99:.1f} ms")
    return p50, p99


def add_run(figure: Figure, value: float, anchor: tuple[float, float] | None) -> None:
    """One run of a ratio-judged figure: its value and the p99 of the anchor measured next
    to it (0 when it could not be: that run then fails the target)."""
    figure.ours.append(value)
    figure.e2e_p99.append(anchor[1] if anchor else 0.0)


def log_ratio(ctx: Context, what: str, value: float, anchor: tuple[float, float] | None,
              limit: float | None) -> None:
    """One run's ratio to the anchor's p99, in the log (against ``limit`` where there is one)."""
    if not anchor or not anchor[1]:
        ctx.log(f"  {what}: {value:.1f} ms; no EndToEndLatency anchor in this run")
        return
    ratio = value / anchor[1]
    verdict = "" if limit is None else (
        f" ({'within' if ratio <= limit else 'OVER'} the {limit:g}x target)")
    ctx.log(f"  {what}: {value:.1f} ms = {ratio:.2f}x EndToEndLatency p99 {anchor[1]:.1f} ms"
            f"{verdict}")


def probe_text(probe: Mapping[str, float] | None) -> str:
    """'loop lag p99/max A/B ms, GC N pauses, T ms in all, max M ms' of one run's probe."""
    if not probe:
        return "no loop probe"
    text = (f"loop lag p99/max {probe['lag_ms_p99']:.1f}/{probe['lag_ms_max']:.1f} ms, "
            f"GC {probe['gc_count']:.0f} pauses, {probe['gc_total_ms']:.1f} ms in all, "
            f"max {probe['gc_max_ms']:.1f} ms")
    if probe.get("batches"):
        text += (f", {probe['batches']:.0f} batches of {probe['batch_mean']:.1f} records "
                 f"on average (max {probe['batch_max']:.0f})")
    return text
