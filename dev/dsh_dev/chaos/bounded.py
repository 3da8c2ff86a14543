"""Coroutines run in a thread of their own, waited for at most a given time.

A broker client that hangs (a node down, a proxy holding the connection) can also hang while
it is being cancelled, and ``asyncio.wait_for`` waits for the cancellation to finish. The
campaign's own reads (lag probes, topic scans) therefore run on a fresh event loop in a daemon
thread: past the timeout the caller goes on and the thread is abandoned (it ends with the
process), so no loop of the campaign can hang on a client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def run_bounded(factory: Callable[[], Coroutine[Any, Any, T]], timeout_s: float) -> T:
    """The result of ``factory()`` run in a daemon thread; TimeoutError after ``timeout_s``."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def target() -> None:
        try:
            future.set_result(asyncio.run(factory()))
        except BaseException as exc:  # handed to the caller, whatever it is
            future.set_exception(exc)

    threading.Thread(target=target, name="chaos-bounded", daemon=True).start()
    done, _ = await asyncio.wait({asyncio.wrap_future(future)}, timeout=timeout_s)
    if not done:
        raise TimeoutError(f"gave up after {timeout_s:.0f} s")
    return done.pop().result()
