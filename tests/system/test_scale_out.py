"""Scale-out on the session's shared 3-node cluster (issue 9 item 4, the small version of
``bench/bench_scale_out.py``): 3 driver processes and 2 processors workers over a
12-partition topic; driver 1 and worker 1 get SIGKILL mid-run. Every session still ends its
turn (the dead driver's sessions move to the survivors, whose crash repair closes the turns
it left open as ``interrupted``; two of its sessions get one more turn after the kill, so the
survivors load sessions whatever the kill found in flight), ``check`` finds every log valid
with no open turn and no unanswered call, and the surviving worker's tables and its
derived-messages topic equal a replay of the session topic.

One run (module fixture), two tests: what the drivers and the log guarantee, and what the
processors guarantee.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scale_out_support import ScaleOutPlan, run_scale_out

from dsh_dev.localstack.kafka import KafkaLocal

pytestmark = [pytest.mark.broker, pytest.mark.cluster, pytest.mark.jars,
              pytest.mark.timeout(900)]

PLAN = ScaleOutPlan(drivers=3, workers=2, sessions=36, turns=1, partitions=12, kill_at=0.3,
                    turns_after_kill=2, driver_session_timeout_ms=6000,
                    worker_session_timeout_s=6.0, timeout_s=240.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory,
        shared_cluster: KafkaLocal) -> Iterator[dict[str, Any]]:
    workdir: Path = tmp_path_factory.mktemp("scale-out")
    figures = asyncio.run(run_scale_out(shared_cluster.bootstrap, PLAN, workdir, print))
    print(figures)
    yield figures


def test_sessions_move_and_every_log_stays_valid(run: dict[str, Any]) -> None:
    assert run["killed"] == "driver 1 and worker 1 (SIGKILL)"
    # Every session ended its turn: completed, or interrupted by the kill and repaired.
    assert run["turns_after_kill"] == PLAN.turns_after_kill
    assert run["turns"] == PLAN.sessions * PLAN.turns + PLAN.turns_after_kill
    kinds = run["turn_end_kinds"]
    assert set(kinds) <= {"completed", "interrupted"}, kinds
    assert kinds.get("interrupted", 0) == run["turns_repaired"]
    # The dead driver's partitions moved: the survivors loaded its sessions that had work
    # (busy at the takeover, or given a turn after the kill), each from its checkpoint.
    assert run["partitions_moved"] >= 1
    assert run["sessions_moved"] >= PLAN.turns_after_kill
    assert run["session_failures"] == 0 and run["dead_letters"] == 0
    # check: every log valid, seq contiguous, no open turn, every call answered.
    assert run["check_ok"], run["check_problems"]
    assert run["check_sessions"] == PLAN.sessions and run["open_turns"] == 0
    assert run["check_events"] == run["events"] == run["replay_events"]
    assert run["replay_log_problems"] == 0 and run["replay_conversations"] == PLAN.sessions


def test_processors_tables_and_topic_equal_the_replay(run: dict[str, Any]) -> None:
    assert (run["derived_mismatches"], run["usage_mismatches"], run["model_mismatches"]) \
        == (0, 0, 0), (run["table_problems"], run.get("diagnosis"))
    assert run["replay_differences"] == 0, (run["replay_problems"], run.get("diagnosis"))
    # Every folded batch was committed: a restart would redeliver nothing (and the commit
    # never stopped at a transaction marker or past a batch nobody folded).
    assert run["uncommitted_records"] == 0, run.get("diagnosis")
