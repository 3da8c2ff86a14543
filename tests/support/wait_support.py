"""The tests' wait for a plain condition (a predicate over in-process state), and for a
driver service that owns every partition."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from pipeline.services.driver.partition import PartitionContext
from pipeline.services.driver.service import DriverConfig, DriverService

WAIT_S = 60.0  # only a failing test waits this long


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll ``predicate`` every 50 ms until it holds; AssertionError naming ``what`` after
    ``timeout_s``."""
    async def wait() -> None:
        while not predicate():
            await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(wait(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"timed out waiting until {what}") from None


@contextlib.asynccontextmanager
async def driver_owning(ctx: PartitionContext, partitions: int,
                        timeout_s: float = WAIT_S) -> AsyncIterator[DriverService]:
    """A :class:`DriverService` on ``ctx`` running until the block ends, entered once it owns
    every one of ``partitions`` (its failure is raised instead, if it fails first)."""
    service = DriverService(ctx, DriverConfig(linger_ms=10, shutdown_grace_s=5,
                                              session_timeout_ms=6000))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))

    async def owning_all() -> None:
        while not (service.ready.is_set() and set(service.owned) == set(range(partitions))):
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(owning_all(), timeout_s)
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout_s)
