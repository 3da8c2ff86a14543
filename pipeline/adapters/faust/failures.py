"""What the worker does when folding a batch fails: read it again, or stop.

Rules:

- Bad records never raise here: the folds dead-letter them and go on. What escapes a fold or
  a persist is the broker or a bug (an output or a read-back that failed, a state that
  cannot be written).
- A failed batch is folded again: the folds gave up its partition's batches since their
  last persist, and the partition is read again from its committed offset
  (:func:`.transport.fetch_again`), after a delay that doubles with each failure in a
  row. The batches after it are not folded meanwhile, so they are never reported as gaps
  (valid records would be dead-lettered).
- After :data:`FOLD_FAILURES_MAX` failures of a partition in a row the worker stops and
  exits 1, naming the partition and the last error (a poison batch is not retried for
  ever; a supervisor restarts the worker, which folds from the committed offsets).
- The broker refusing an output (an ACL lost while the worker ran) stops the worker at
  once, naming its principal (:func:`stop_refused`).
- A table write that was not acknowledged stops the worker at once
  (:func:`stop_write_lost`): its tables are ahead of their changelogs, and only a
  restart (tables restored from the changelogs, folds from the committed offsets) makes
  them agree again.
- A stopping worker exits within :data:`STOP_BUDGET_S` even when faust's stop after the
  crash hangs on its consumer: exiting without that stop is a kill -9, which loses nothing
  acknowledged (nothing uncommitted was acknowledged).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final, Protocol

from pipeline.adapters.faust.transport import fetch_again
from pipeline.adapters.kafka.errors import kafka_error
from pipeline.core.errors import BrokerError

log = logging.getLogger(__name__)

FOLD_FAILURES_MAX: Final = 10   # in a row, per partition: ~1 min of doubling delays
STOP_BUDGET_S: Final = 30.0


class FoldFailed(RuntimeError):
    """A partition's batches failed to fold too many times in a row (the broker, or a
    bug): the worker stops."""


class WorkerStop:
    """Stops the worker once (faust's crash, then an exit within :data:`STOP_BUDGET_S`)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._stopping: list[Any] = []   # the crash's task, kept until it is done

    @property
    def stopping(self) -> bool:
        return bool(self._stopping)

    def __call__(self, error: BaseException) -> None:
        if self._stopping:
            return
        self._stopping.append(asyncio.ensure_future(self.app.crash(error)))
        _exit_unless_stopped_within(STOP_BUDGET_S)


def stop_refused(stop: WorkerStop, principal: str, exc: Exception) -> None:
    """The broker refused an output (the worker's principal lost an ACL while it ran): say
    why, naming the principal, and stop. The graceful stop commits only batches whose
    outputs and tables were written: the refused ones are folded again by the next
    worker."""
    if stop.stopping:
        return
    error: BrokerError = kafka_error("writing the processors' outputs", exc)
    log.critical("%s [as principal User:%s]: the worker stops; what it folded since its "
                 "last commit is folded again after a restart", error, principal)
    stop(error)


def stop_write_lost(stop: WorkerStop, exc: Exception) -> None:
    """A table write was not acknowledged: say so and stop."""
    if stop.stopping:
        return
    log.critical("a table write was not acknowledged (%s: %s): the worker stops; its "
                 "next start restores the tables from their changelogs",
                 type(exc).__name__, exc)
    stop(exc)


def fold_again(stop: WorkerStop, topic: str, partition: int, error: Exception) -> None:
    """``topic[partition]``'s batches were given up (``error``): read the partition again,
    or stop past :data:`FOLD_FAILURES_MAX` failures in a row."""
    failures = fetch_again(stop.app, topic, partition)
    if failures <= FOLD_FAILURES_MAX or stop.stopping:
        return
    log.critical("%s[%d] failed to fold %d times in a row (last: %s: %s): the worker "
                 "stops; a restart folds it from the committed offset", topic, partition,
                 failures, type(error).__name__, error)
    stop(FoldFailed(f"{topic}[{partition}] failed to fold {failures} times in a row"))


class FailureCount(Protocol):
    failed_batches: int


@asynccontextmanager
async def folding_again_on_failure(event: Any, counters: FailureCount, stop: WorkerStop,
                                   ) -> AsyncIterator[None]:
    """Around the fold of one batch (a faust event): when it raises, the batch is folded
    again (:func:`fold_again`).

    faust acks the event an agent raised on (and restarts the agent): it is marked acked
    without telling the consumer instead, and never marked folded, so the commit of its
    partition stops before it (:func:`pipeline.adapters.faust.commit_rule.commit_offset`)
    until its records, read again, are folded.
    """
    try:
        yield
    except Exception as exc:
        message = event.message
        message.acked = True
        counters.failed_batches += 1
        log.exception("folding %s[%d] up to offset %d failed; its partition is read again "
                      "from the committed offset", message.topic, message.partition,
                      message.offset)
        fold_again(stop, message.topic, message.partition, exc)
        raise


def _exit_unless_stopped_within(budget_s: float) -> None:
    def give_up() -> None:
        log.critical("the worker's stop did not finish within %.0fs: exiting now", budget_s)
        logging.shutdown()
        os._exit(1)
    timer = threading.Timer(budget_s, give_up)
    timer.daemon = True
    timer.start()
