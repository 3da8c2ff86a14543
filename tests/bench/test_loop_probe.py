"""The benchmarks' loop-lag and collector probe (issue 33), and the suite's ratio goals."""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from pathlib import Path

import pytest

from pipeline.adapters.loop_probe import LoopProbe, probing, wanted

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from suite_core import Figure


async def test_a_blocked_loop_shows_as_lag_and_a_collection_as_a_pause() -> None:
    async with probing(interval_s=0.005) as probe:
        await asyncio.sleep(0.05)
        time.sleep(0.06)   # holds the loop: the sleeper wakes ~60 ms late
        gc.collect()
        await asyncio.sleep(0.02)
        seen = probe.window()
        assert seen["lag_ms_max"] >= 40
        assert seen["gc_count"] >= 1 and seen["gc_total_ms"] >= seen["gc_max_ms"] > 0
        assert probe.window()["gc_count"] == 0   # a window forgets what it returned
    assert probe._on_gc not in gc.callbacks


async def test_counted_batches_give_their_sizes() -> None:
    probe = LoopProbe()
    seen: list[int] = []

    async def handle(records: object, _batch: object) -> None:
        seen.append(len(records))  # type: ignore[arg-type]

    counted = probe.counting(handle)
    await counted([1, 2, 3], None)
    await counted([1], None)
    window = probe.window()
    assert seen == [3, 1]
    assert (window["batches"], window["batch_mean"], window["batch_max"]) == (2, 2.0, 3)


def test_the_probe_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSH_LOOP_PROBE", raising=False)
    assert not wanted()
    monkeypatch.setenv("DSH_LOOP_PROBE", "0")
    assert not wanted()
    monkeypatch.setenv("DSH_LOOP_PROBE", "1")
    assert wanted()


def test_a_ratio_goal_holds_only_when_every_run_meets_it() -> None:
    figure = Figure("p99", "ms", [20.0, 30.0, 45.0], higher_is_better=False)
    figure.e2e_p99 = [8.0, 9.0, 12.0]
    figure.judge_ratios(4.0)
    assert figure.met and figure.run_ratios == [2.5, 30.0 / 9.0, 3.75]
    figure.e2e_p99 = [8.0, 9.0, 10.0]   # the last run at 4.5x
    figure.judge_ratios(4.0)
    assert not figure.met
    figure.e2e_p99 = [8.0, 9.0, 0.0]    # a run without its anchor cannot meet it
    figure.judge_ratios(4.0)
    assert not figure.met
