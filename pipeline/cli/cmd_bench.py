"""``dsh-pipeline bench``: run the benchmark suite of the checkout (``bench/suite.py``).

The suite lives in the checkout, not in the installed package (it reuses the tests' worker
helpers and is not shipped in the image), so this command runs it in a child interpreter, the
same one as this process, and returns its exit code: 0 when every benchmark produced its
figures, 1 when one failed (the others still run and are reported), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.adapters.localstack.artifacts import CHECKOUT_ROOT
from pipeline.core.errors import ConfigError
from pipeline.settings import Settings

SUITE = CHECKOUT_ROOT / "bench" / "suite.py"
BENCHMARK_NAMES = ("avro", "fold", "memory", "state", "ingest", "processors", "driver", "replay",
                   "otel", "import", "dashboard", "browser", "idle", "scaleout", "secure",
                   "restart", "approval", "mcp", "history", "page", "budget")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench", help="run the benchmarks against their anchors and write BENCHMARKS.md",
        description="Run the benchmark suite (bench/suite.py): each figure beside its anchor "
                    "measured in the same run (Kafka's perf tools, fastavro, a naive fold, a "
                    "plain JSON producer). Starts a local Kafka unless --bootstrap is given.")
    parser.add_argument("--quick", action="store_true",
                        help="run every benchmark briefly (CI); figures are not meaningful")
    parser.add_argument("--only", nargs="+", choices=BENCHMARK_NAMES, metavar="NAME",
                        help=f"run only these benchmarks: {', '.join(BENCHMARK_NAMES)}")
    parser.add_argument("--output", type=Path, default=CHECKOUT_ROOT / "BENCHMARKS.md",
                        metavar="FILE", help="the Markdown report to write "
                                             "(default: BENCHMARKS.md of the checkout)")
    parser.add_argument("--bootstrap", default="", metavar="HOST:PORT",
                        help="use this Kafka instead of starting a local one")
    parser.add_argument("--cluster", default="", metavar="HOST:PORT,...",
                        help="run the scale-out benchmark on this 3-node cluster (replication "
                             "3, min ISR 2; its brokers' CPU is not measured) instead of "
                             "starting one")
    parser.add_argument("--runs", type=int, default=0, metavar="N",
                        help="runs per figure (default 3; 1 with --quick)")
    parser.set_defaults(func=run_bench)


def suite_argv(args: argparse.Namespace) -> list[str]:
    """The suite's command line for the parsed options."""
    argv = [sys.executable, str(SUITE), "--output", str(args.output.resolve())]
    if args.quick:
        argv.append("--quick")
    if args.only:
        argv += ["--only", *args.only]
    if args.bootstrap:
        argv += ["--bootstrap", args.bootstrap]
    if args.cluster:
        argv += ["--cluster", args.cluster]
    if args.runs:
        if args.runs < 1:
            raise ConfigError(f"--runs must be at least 1, got {args.runs}")
        argv += ["--runs", str(args.runs)]
    return argv


def run_bench(args: argparse.Namespace, settings: Settings) -> int:
    if not SUITE.is_file():
        raise ConfigError(f"the benchmark suite is not at {SUITE}: `dsh-pipeline bench` runs "
                          "from a checkout of the repository")
    done = subprocess.run(suite_argv(args), cwd=SUITE.parent, check=False)
    return done.returncode
