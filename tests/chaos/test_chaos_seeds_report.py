"""``dsh-pipeline chaos --seeds N``: seeds from the clock, and one report naming each seed.

The campaigns themselves run in ``tests/chaos/test_chaos_short.py`` (a cluster); here the report
and the seeds, from outcomes built as the campaign builds them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from dsh_dev.chaos.campaign import CampaignOptions, Outcome
from dsh_dev.chaos.invariants import Result
from dsh_dev.chaos.report import render_seeds
from dsh_dev.cli.cmd_chaos import clock_seed, run
from pipeline.core.errors import ConfigError
from pipeline.settings import Settings


def outcome(seed: int, failed: str | None = None) -> tuple[Outcome, str]:
    done = Outcome(CampaignOptions(seed, 200, 36, 204, Path("/tmp")))
    done.results = [Result("session logs strict-valid", True, "200 sessions")]
    if failed:
        bad = Result(failed, True, "212 sessions compared")
        bad.add("chaos-0076: worker never reached seq 124")
        done.results.append(bad)
    return done, f"dsh-pipeline chaos --minutes 4 --seed {seed} --sessions 200 --rate 4"


def test_each_seed_is_a_row_and_a_failing_seed_has_a_section_naming_it() -> None:
    text = render_seeds([outcome(101), outcome(22142, "tables equal a replay")], 3)
    assert "2 of 3 campaigns run, 1 passed" in text
    assert "| 1 | 101 | PASS | - |" in text
    assert "| 2 | 22142 | **FAIL** | tables equal a replay |" in text
    assert "`dsh-pipeline chaos --minutes 4 --seed 22142 --sessions 200 --rate 4`" in text
    section = text[text.index("## Campaign 2: seed 22142, FAIL"):]
    assert "chaos-0076: worker never reached seq 124" in section
    assert "\n### Faults by kind" in section and "\n## Faults" not in section


def test_clock_seeds_are_in_range_and_change_with_the_clock() -> None:
    seeds = set()
    for _ in range(5):
        seeds.add(clock_seed())
        time.sleep(0.002)
    assert all(1 <= seed <= 999_999 for seed in seeds) and len(seeds) > 1


@pytest.mark.parametrize("seeds, seed", [(0, None), (3, 7)])
def test_seeds_refuses_a_count_below_one_and_a_seed_beside_it(seeds: int, seed: int | None
                                                              ) -> None:
    args = argparse.Namespace(minutes=1.0, sessions=1, rate=1.0, seeds=seeds, seed=seed)
    with pytest.raises(ConfigError, match="--seeds"):
        run(args, Settings.from_env({}))
