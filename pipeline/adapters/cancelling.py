"""Cancelling tasks that run client calls, until they have ended.

A cancellation can be lost inside a client call: CPython 3.11's ``asyncio.wait_for``, which
aiokafka uses throughout, may swallow one when its inner future completes at the same moment
(fixed in 3.12, where ``wait_for`` is built on ``asyncio.timeout``). A service loop that
retries after a failure then goes on to its retry sleep, and a stop that cancelled it once
and awaits it waits for ever (seen in CI: a dashboard stopped right after it started).
:func:`cancel_until_done` cancels again, every ``recancel_s``, each task still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Final

RECANCEL_S: Final = 1.0


async def cancel_until_done(tasks: Iterable[asyncio.Future[Any]], *,
                            recancel_s: float = RECANCEL_S) -> list[asyncio.Future[Any]]:
    """Cancel ``tasks`` until every one has ended; returns them (their outcome retrieved:
    the caller reads ``exception()`` of those not cancelled, if it cares)."""
    ended: list[asyncio.Future[Any]] = []
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=recancel_s)
        for task in done:
            if not task.cancelled():
                task.exception()   # retrieved: no "exception was never retrieved" later
        ended += done
    return ended
