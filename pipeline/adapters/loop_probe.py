"""An instrument for finding a latency tail (issue 33): how late the event loop wakes, and
how long the cyclic garbage collector stops the process.

A task sleeps ``interval_s`` over and over and records how much later than asked it woke
(whatever held the loop meanwhile: a long callback, a collection, the machine's scheduler);
a ``gc.callbacks`` hook records each collection's pause. Optionally it counts the batch sizes
a worker folds (:meth:`LoopProbe.counting`). Off by default: a process turns it on where the
environment names it (``DSH_LOOP_PROBE=1``, :func:`wanted`); the benchmarks read a window of
it (:meth:`LoopProbe.window`, which starts the next one).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

ENV = "DSH_LOOP_PROBE"
INTERVAL_S = 0.010
KEPT = 100_000   # samples of each kind kept between two windows (~17 minutes of lag)


def wanted() -> bool:
    """Whether this process is asked to run the probe (``DSH_LOOP_PROBE`` set, not 0)."""
    return os.environ.get(ENV, "0") not in ("", "0")


class LoopProbe:
    """Loop lag, collector pauses and batch sizes since the last :meth:`window`."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.lags_ms: deque[float] = deque(maxlen=KEPT)
        self.gc_ms: deque[float] = deque(maxlen=KEPT)
        self.batches: deque[int] = deque(maxlen=KEPT)
        self._gc_began = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the sleeper on the running loop and hook the collector."""
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.get_running_loop().create_task(self._sleeper())

    async def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _sleeper(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            late = time.perf_counter() - asked - self.interval_s
            self.lags_ms.append(max(0.0, late) * 1000)

    def _on_gc(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began:
            self.gc_ms.append((time.perf_counter() - self._gc_began) * 1000)

    def counting(self, handle: Callable[[Sequence[Any], Any], Awaitable[None]]
                 ) -> Callable[[Sequence[Any], Any], Awaitable[None]]:
        """``handle`` (a batch handler), noting each batch's size first."""
        async def counted(records: Sequence[Any], batch: Any) -> None:
            self.batches.append(len(records))
            await handle(records, batch)
        return counted

    def window(self) -> dict[str, float]:
        """What was seen since the previous call (which it forgets): loop lag p50/p99/max,
        collector pauses count/total/max (ms), and batch count/mean/max where counted."""
        lags, pauses, batches = list(self.lags_ms), list(self.gc_ms), list(self.batches)
        self.lags_ms.clear()
        self.gc_ms.clear()
        self.batches.clear()
        lags.sort()
        return {"lag_samples": len(lags), "lag_ms_p50": _at(lags, 0.5),
                "lag_ms_p99": _at(lags, 0.99), "lag_ms_max": _at(lags, 1.0),
                "gc_count": len(pauses), "gc_total_ms": round(sum(pauses), 2),
                "gc_max_ms": round(max(pauses, default=0.0), 2),
                "batches": len(batches),
                "batch_mean": round(sum(batches) / len(batches), 1) if batches else 0.0,
                "batch_max": max(batches, default=0)}


def _at(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values by nearest rank (0 for none), to 0.01."""
    if not ordered:
        return 0.0
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


@contextlib.asynccontextmanager
async def probing(interval_s: float = INTERVAL_S) -> AsyncIterator[LoopProbe]:
    """A probe running on this loop for the block."""
    probe = LoopProbe(interval_s)
    probe.start()
    try:
        yield probe
    finally:
        await probe.stop()
