"""Garbage-collector settings for a process that runs the driver.

Why: a driver holds every owned session's log in memory, hundreds of thousands of objects that
live as long as their session is owned and that nothing ever mutates. CPython's defaults
(a young collection every 700 container allocations, a full collection each time the heap has
grown by a quarter) keep scanning them: measured with ``bench/bench_runner.py`` (1,000
sessions), collections take about a fifth of the driver's CPU, and a full collection over
that heap stops the event loop for 100-250 ms, the tail of a step's overhead.

:func:`driver_gc` (a context manager around the driver's run) therefore

* raises the young-generation threshold (``YOUNG_THRESHOLD``): most objects a step allocates
  (coroutines, futures, chunk dicts) are gone before a collection sees them, so fewer of them
  are scanned at all and promoted to be scanned again;
* lets the driver :meth:`DriverGc.freeze` what is live at quiet points (after a partition's
  sessions are rebuilt, and every ``freeze_every_s`` while running): frozen objects sit in the
  permanent generation and no collection scans them again, so a full collection only walks
  what was allocated since the last freeze;
* unfreezes on :meth:`DriverGc.release` (a partition given up) and on exit, so that whatever
  became garbage meanwhile (a released partition's sessions, reference cycles that were live
  at a freeze) is collected by the next full collection instead of staying pinned.

Reference counting still frees frozen objects as soon as nothing refers to them: only garbage
in reference cycles waits for an unfreeze. The settings are process-wide; the previous
thresholds are restored on exit.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

YOUNG_THRESHOLD: Final = 20_000  # container allocations between young collections (700)
FREEZE_EVERY_S: Final = 60.0


class DriverGc:
    """The collector policy of one running driver (see the module docs)."""

    def __init__(self, *, freeze_every_s: float = FREEZE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._freeze_every_s = freeze_every_s
        self._clock = clock
        self._last_freeze = clock()
        self.freezes = 0

    def freeze(self) -> None:
        """Exclude everything live now from future collections (a quiet point)."""
        gc.freeze()
        self.freezes += 1
        self._last_freeze = self._clock()

    def tick(self) -> None:
        """Called from the driver's loop: freeze when the last freeze is old enough."""
        if self._clock() - self._last_freeze >= self._freeze_every_s:
            self.freeze()

    def release(self) -> None:
        """Something long-lived was given up: make frozen objects collectable again."""
        gc.unfreeze()


_outer_thresholds: list[tuple[int, int, int]] = []  # saved by the outermost driver_gc


@contextmanager
def driver_gc(*, freeze_every_s: float = FREEZE_EVERY_S,
              young_threshold: int = YOUNG_THRESHOLD) -> Iterator[DriverGc]:
    """Run a driver with its collector policy; the outermost one restores the previous
    thresholds on exit (several drivers may run in one process, e.g. in tests)."""
    outermost = not _outer_thresholds
    if outermost:
        _outer_thresholds.append(gc.get_threshold())
        first, *older = _outer_thresholds[0]
        gc.set_threshold(max(young_threshold, first), *older)
    policy = DriverGc(freeze_every_s=freeze_every_s)
    policy.freeze()  # the process's start-up state (modules, settings, clients)
    try:
        yield policy
    finally:
        gc.unfreeze()
        if outermost:
            gc.set_threshold(*_outer_thresholds.pop())
