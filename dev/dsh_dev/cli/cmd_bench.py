"""``dsh-pipeline bench``: run the benchmark suite of a checkout (``bench/suite.py``).

The suite lives in the checkout, not in an installed package (it reuses the tests' worker
helpers and is not shipped in the image): ``--checkout DIR`` names the checkout, the current
directory by default. This command runs the suite in a child interpreter, the same one as this
process, and returns its exit code: 0 when every benchmark produced its figures, 1 when one
failed (the others still run and are reported), 2 on a usage error (no suite found).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.core.errors import ConfigError
from pipeline.settings import Settings

# The suite and the report, relative to the checkout (--checkout, the current directory).
SUITE = Path("bench") / "suite.py"
REPORT = Path("BENCHMARKS.md")
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
    parser.add_argument("--checkout", type=Path, default=Path("."), metavar="DIR",
                        help="the repository checkout holding bench/suite.py (default: the "
                             "current directory)")
    parser.add_argument("--output", type=Path, default=None,
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
    output = args.output if args.output is not None else args.checkout / REPORT
    argv = [sys.executable, str(suite_of(args.checkout)), "--output", str(output.resolve())]
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


def suite_of(checkout: Path) -> Path:
    """The checkout's ``bench/suite.py``; :class:`ConfigError` saying how to find it."""
    suite = (checkout / SUITE).resolve()
    if not suite.is_file():
        raise ConfigError(f"no benchmark suite at {suite}: run `dsh-pipeline bench` at the top "
                          "of a checkout of the repository, or name one with --checkout DIR")
    return suite


def run_bench(args: argparse.Namespace, settings: Settings) -> int:
    suite = suite_of(args.checkout)
    done = subprocess.run(suite_argv(args), cwd=suite.parent, check=False)
    return done.returncode
