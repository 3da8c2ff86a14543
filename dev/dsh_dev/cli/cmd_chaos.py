"""``dsh-pipeline chaos``: run the whole pipeline under randomized faults and check it.

Starts a 3-node cluster behind Toxiproxy, 2 drivers, 2 processors workers, the dashboard, a
shipper and a local streaming provider; loads N sessions with random inbox commands; runs
faults drawn from ``--seed`` (kill -9 of services and brokers, SIGSTOP of a driver, network
toxics, provider faults, garbage records); lets the fleet settle; checks every invariant;
writes the report (``--report``, default ``CHAOS.md``). Exit 0 when every invariant held, 1
when one was violated (the report and stderr name the session, seq or offset), 2 on a setup
error. Everything started is stopped, also on Ctrl-C or SIGTERM. See docs/chaos.md.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, Final

from dsh_dev.chaos.campaign import Campaign, CampaignOptions, Outcome, derive_seed
from dsh_dev.chaos.fleet import DEFAULT_STORE
from dsh_dev.chaos.report import write_raw, write_report, write_seeds_report
from dsh_dev.localstack.artifacts import default_cache_dir
from pipeline.core.errors import ConfigError
from pipeline.settings import Settings

BASELINE_SHARE: Final = 0.15
MIN_BASELINE_S: Final = 20.0


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "chaos", help="run the pipeline under randomized faults and check nothing was lost",
        description="The chaos campaign: a local fleet under faults drawn from a seed, then "
                    "every invariant checked and CHAOS.md written (docs/chaos.md).")
    parser.add_argument("--minutes", type=float, default=15.0, metavar="M",
                        help="minutes of load: 15%% without faults, the rest with (15)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="seed of the load and the faults (default: a random one, printed)")
    parser.add_argument("--seeds", type=int, default=None, metavar="N",
                        help="run N campaigns in a row, each with a seed taken from the clock, "
                             "and report each seed with its result (one report: a summary, "
                             "then each campaign's section); exit 1 if any failed")
    parser.add_argument("--sessions", type=int, default=200, metavar="N",
                        help="agent sessions receiving inbox commands (200)")
    parser.add_argument("--rate", type=float, default=4.0, metavar="R",
                        help="inbox commands per second after each session's first two (4)")
    parser.add_argument("--store", default=DEFAULT_STORE,
                        help="processors table store: rocksdb:// (the shipped one) or "
                             "memory://")
    parser.add_argument("--toxiproxy", type=Path, default=None, metavar="PATH",
                        help="Toxiproxy server binary (default: the one `make toxiproxy` "
                             "installs in the cache)")
    parser.add_argument("--report", type=Path, default=Path("CHAOS.md"), metavar="FILE",
                        help="where to write the report (CHAOS.md)")
    parser.add_argument("--workdir", type=Path, default=None, metavar="DIR",
                        help="logs and broker data (default <cache>/chaos/<seed>-<time>; "
                             "with --seeds, DIR/<seed>-<time> for each campaign)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.minutes <= 0 or args.sessions < 1 or args.rate <= 0:
        raise ConfigError("--minutes and --rate must be positive and --sessions at least 1")
    if args.seeds is None:
        outcome, command = _campaign(args, settings, derive_seed(args.seed))
        write_report(outcome, args.report, command)
        _progress(f"report: {args.report}")
        return 0 if outcome.ok else 1
    if args.seeds < 1 or args.seed is not None:
        raise ConfigError("--seeds takes a count of at least 1, and no --seed with it")
    runs: list[tuple[Outcome, str]] = []
    for number in range(1, args.seeds + 1):
        seed = clock_seed()
        _progress(f"campaign {number} of {args.seeds}: seed {seed}")
        runs.append(_campaign(args, settings, seed))
        write_seeds_report(runs, args.seeds, args.report)   # after each: a stop keeps it
        _progress(f"campaign {number} of {args.seeds}, seed {seed}: "
                  f"{'PASS' if runs[-1][0].ok else 'FAIL'} (report: {args.report})")
    failed = [outcome.options.seed for outcome, _ in runs if not outcome.ok]
    _progress(f"{args.seeds - len(failed)} of {args.seeds} campaigns passed"
              + (f"; failed seeds: {', '.join(map(str, failed))}" if failed else ""))
    return 1 if failed else 0


def clock_seed() -> int:
    """A seed nobody chose: the clock's milliseconds, folded into 1..999,999."""
    return int(time.time() * 1000) % 999_999 + 1


def _campaign(args: argparse.Namespace, settings: Settings, seed: int
              ) -> tuple[Outcome, str]:
    """One campaign with ``seed``: its outcome and the command that reruns it."""
    total_s = args.minutes * 60
    baseline_s = max(MIN_BASELINE_S, BASELINE_SHARE * total_s)
    run_name = f"{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir = (default_cache_dir() / "chaos" / run_name if args.workdir is None
               else args.workdir / run_name if args.seeds else args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    # The campaign's own clients log every refused connection while a node is down: to a
    # file, so that the progress lines stay readable.
    logging.basicConfig(filename=workdir / "campaign.log", level=logging.WARNING, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = CampaignOptions(seed=seed, sessions=args.sessions, baseline_s=baseline_s,
                              fault_s=max(30.0, total_s - baseline_s), workdir=workdir,
                              rate_per_s=args.rate, store=args.store, toxiproxy=args.toxiproxy)
    _progress(f"chaos: seed {seed}, {args.sessions} sessions, {args.minutes:g} min; "
              f"logs in {workdir}")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        outcome = Campaign(options, settings, _progress).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    command = (f"dsh-pipeline chaos --minutes {args.minutes:g} --seed {seed} "
               f"--sessions {args.sessions} --rate {args.rate:g}")
    if args.store != DEFAULT_STORE:
        command += f" --store {shlex.quote(args.store)}"
    write_raw(outcome, workdir)
    for result in [*outcome.results, *outcome.periodic]:
        mark = "held" if result.ok else "VIOLATED"
        _progress(f"{mark}: {result.name} ({result.summary})")
        for violation in result.violations:
            _progress(f"  {violation}")
        for note in result.notes:
            _progress(f"  note: {note}")
    return outcome, command


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _progress(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)
