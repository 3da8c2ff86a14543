"""Step admission: how many sessions of a partition may begin a step per transaction.

Every runner of a driver shares one event loop with the partitions' transaction flushers,
the producers' senders and the inbox consumer. A runner whose model answers at once runs
its whole step without suspending, so when many sessions are ready together (a burst of
follow-ups, or every session whose step just committed) all of their steps run in one go,
and their events pile into one large transaction while the next wave waits behind it: the
records of a wave wait for the whole wave's transaction, then for the one before it.

:class:`StepBudget` bounds that per inbox partition: a runner awaits its partition's
budget before it begins a step (its first effect after a step boundary or an idle check),
and at most ``per_renewal`` runners are admitted between two transactions of the
partition; the others wait in arrival order (first come, first served: no session
starves). So each transaction carries the events of a bounded number of steps, takes a
bounded time, and an appended event waits for about one transaction, not for a wave.

What is admitted is the start of a step; its events are stamped when they are appended
(after admission), so the time a session waits here is queueing before its step, not part
of "appended -> readable" (the runner publishes what is already logged, e.g. a command's
inbox splice, before it waits). Nothing about what a transaction holds changes: records,
their order and the inbox offsets are exactly as without admission, so exactly-once appends
and crash recovery are unchanged. A session waiting here is not yet stepping; a cancel sent
meanwhile takes effect when it is admitted, before its step begins.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class StepBudget:
    """At most ``per_renewal`` step starts between two renewals, in arrival order.

    The owner (a partition's transaction flusher) calls :meth:`renew` each time a
    transaction takes the records buffered so far, so each transaction holds the events of
    at most about ``per_renewal`` steps begun while the previous one committed, and the
    steps of a burst spread over the following transactions instead of piling into one.

    A step may be admitted and emit little for a long time (a model that streams slowly, a
    pre-step hook): then transactions are small, or none comes to renew the budget, and
    holding other sessions back bounds nothing. So while runners wait, every ``stall_s`` the
    budget is renewed anyway if ``little_buffered()`` says less than a transaction's worth of
    records waits for the next transaction.
    """

    def __init__(self, per_renewal: int, *, stall_s: float,
                 little_buffered: Callable[[], bool]) -> None:
        if per_renewal < 1:
            raise ValueError(f"per_renewal must be >= 1, got {per_renewal}")
        self.per_renewal = per_renewal
        self._left = per_renewal
        self._stall_s = stall_s
        self._little_buffered = little_buffered
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._open = False  # released for good (the owner failed or closes)
        self.queued = 0  # step starts that had to wait for a renewal

    async def admit(self) -> None:
        """Return when this runner may begin a step (at once while the budget lasts)."""
        if self._open or (self._left > 0 and not self._waiting):
            self._left -= 1
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiting.append(waiter)
        self.queued += 1
        if self._timer is None:
            self._timer = loop.call_later(self._stall_s, self._on_stall, loop)
        await waiter

    def renew(self) -> None:
        """A transaction took the buffered records: admit up to ``per_renewal`` more."""
        self._left = self.per_renewal
        while self._left > 0 and self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._left -= 1

    def open(self) -> None:
        """Admit everyone from now on (the owner stops: waiters must not hang)."""
        self._open = True
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _on_stall(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if self._little_buffered():
            self.renew()
        if self._waiting:
            self._timer = loop.call_later(self._stall_s, self._on_stall, loop)

