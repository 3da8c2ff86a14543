"""The tests' wait for a plain condition (a predicate over in-process state)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

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
