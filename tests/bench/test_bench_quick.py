"""`dsh-pipeline bench --quick` end to end against the test broker (the scale-out benchmark on
the session's shared 3-node cluster): every benchmark produces its figures and the report is
written. No assertion on any timing (figures go to
BENCHMARKS.md, not to tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsh_dev.cli.cmd_bench import BENCHMARK_NAMES, SUITE
from dsh_dev.localstack.kafka import KafkaLocal

pytestmark = pytest.mark.broker


@pytest.mark.long
def test_quick_suite_gives_every_figure_and_writes_the_report(
        kafka_bootstrap: str, shared_cluster: KafkaLocal, tmp_path: Path) -> None:
    report = tmp_path / "BENCHMARKS.md"
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.main", "bench", "--quick",
         "--bootstrap", kafka_bootstrap, "--cluster", shared_cluster.bootstrap,
         "--output", str(report)],
        capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, _failures(done.stderr)
    figures = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {f["benchmark"] for f in figures} == set(BENCHMARK_NAMES)
    empty = [f["figure"] for f in figures if not f["ours"]]
    assert not empty, f"figures without a value: {empty}"
    text = report.read_text()
    assert "--quick" in text and "Load average" in text
    for figure in figures:
        assert figure["figure"] in text


def test_unknown_benchmark_name_is_a_usage_error() -> None:
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "bench", "--only",
                           "nonsense"], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "nonsense" in done.stderr and "invalid choice" in done.stderr


def test_suite_is_in_the_checkout() -> None:
    assert SUITE.is_file()


def _failures(stderr: str) -> str:
    """Each failed benchmark's traceback (the suite logs ``NAME: FAILED`` and it), without
    the children's INFO lines around it, then the end of the output."""
    lines = [line for line in stderr.splitlines() if " INFO " not in line]
    found = [n for n, line in enumerate(lines) if line.rstrip().endswith(": FAILED")]
    blocks = ["\n".join(lines[n:n + 60])[-6000:] for n in found]
    return "\n---\n".join([*blocks, "\n".join(lines[-30:])])
