"""Run a processors worker in the foreground until SIGTERM/SIGINT (faust's worker loop)."""

from __future__ import annotations

import asyncio
import logging

import faust

from pipeline.services.processors.app import Processors


def run_worker(processors: Processors, *, loglevel: str = "WARNING") -> int:
    """Block running the worker; returns its exit code.

    faust installs its own signal handlers: SIGTERM and SIGINT stop the worker gracefully
    (tables flushed, offsets committed, the group left, so another worker takes over).
    """
    # The CLI may have used asyncio.run() before (topic checks), which leaves no current
    # loop; faust's worker expects one.
    asyncio.set_event_loop(asyncio.new_event_loop())
    worker = faust.Worker(processors.app, loglevel=loglevel, quiet=True,
                          redirect_stdouts=False)
    logging.getLogger("faust").setLevel(loglevel)
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int | None) else 1
    return 0
