"""Run a processors worker in the foreground until SIGTERM/SIGINT (faust's worker loop)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import faust

from pipeline.adapters.kafka.errors import is_refusal, kafka_error
from pipeline.core.errors import DshError
from pipeline.services.processors.worker import Processors


def run_worker(processors: Processors, *, loglevel: str = "WARNING",
               own_logging: bool = False) -> int:
    """Block running the worker; returns its exit code. ``own_logging``: the caller has set
    up the root logger (JSON lines, say), and faust leaves it as it is.

    faust installs its own signal handlers: SIGTERM and SIGINT stop the worker gracefully
    (tables flushed, offsets committed, the group left, so another worker takes over).
    A crash with one of our errors (a refused output, say) or a broker's refusal (a fetch
    refused: the principal lost its Read ACL) is raised once the worker stopped.
    """
    # The CLI may have used asyncio.run() before (topic checks), which leaves no current
    # loop; faust's worker expects one.
    asyncio.set_event_loop(asyncio.new_event_loop())
    Path(processors.options.data_dir).mkdir(parents=True, exist_ok=True)
    worker = faust.Worker(processors.app, loglevel=loglevel, quiet=True,
                          redirect_stdouts=False, override_logging=not own_logging)
    # With a level of WARNING or above, faust's start-up spinner sets the ROOT logger to
    # DEBUG (to spin on every record): every debug call of aiokafka and faust then builds
    # a log record, about 7% of a busy worker's CPU. No spinner: the level stays as asked.
    worker.spinner = None
    logging.getLogger("faust").setLevel(loglevel)
    code = 0
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    # faust logs a crash during start-up and then exits "normally": report it as a failure.
    crashed = worker.crash_reason or processors.app.crash_reason
    if crashed is not None and is_refusal(crashed):   # e.g. faust's fetcher refused a Read
        crashed = kafka_error("the processors worker stopped", crashed)
    if isinstance(crashed, DshError):
        raise crashed   # the CLI says it (with the principal) under its exit-code convention
    return 1 if crashed is not None and code == 0 else code
