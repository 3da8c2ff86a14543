"""The driver's provider rate budgets as awaits (the rules: :mod:`pipeline.core.rate_budget`).

A model call waits here for its grant *before* the provider is asked, so a waiting step
holds no connection. Each waiting call polls the budget when the budget says the next grant
may be due; a grant that falls to another call resolves that call's future. A cancelled wait
(a cancel command, a shutdown) leaves the queue.

The budgets are this process's share of the fleet's limits: the driver holds ``owned / all``
of the partitions, and :meth:`ProviderGate.reshare` is called when the group rebalances. A
driver that dies leaves its share unused until the rebalance hands its partitions (and so
its share) to the survivors, after the session timeout: the fleet then runs below the limit
for that long, never above it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pipeline.core.rate_budget import ProviderLimits, RateBudget, RateSignal, Ticket, observe


@dataclass(slots=True)
class GateCounters:
    """What the gate did: grants, the seconds calls waited, the calls waiting now."""

    grants: int = 0
    waited_s: float = 0.0
    longest_wait_s: float = 0.0
    waiting: int = 0


class ProviderGate:
    """Grants model calls from the budgets of ``limits`` (a model without one: at once)."""

    def __init__(self, limits: ProviderLimits, *, share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.share = share
        self.counters = GateCounters()
        self._clock = clock
        self._budgets: dict[tuple[str, str], RateBudget | None] = {}
        self._granted: dict[int, asyncio.Future[None]] = {}

    def budget(self, provider: str, model: str) -> RateBudget | None:
        key = (provider, model)
        if key not in self._budgets:
            limit = self.limits.limit_of(provider, model)
            self._budgets[key] = None if limit is None else RateBudget(
                limit, self._clock(), share=self.share, weights=self.limits.weights,
                tenant_limits=self.limits.tenant_limits)
        return self._budgets[key]

    async def acquire(self, provider: str, model: str, *, tenant: str, session_id: str,
                      tokens: int, on_wait: Callable[[], Awaitable[None]] | None = None
                      ) -> float:
        """Wait for the call's grant; the seconds it waited. ``on_wait`` is awaited once,
        before the first wait, when the call is not granted at once (the runner logs it)."""
        budget = self.budget(provider, model)
        if budget is None:
            return 0.0
        started = self._clock()
        ticket = budget.enqueue(Ticket(tenant, session_id, tokens))
        mine = self._granted[id(ticket)] = asyncio.get_running_loop().create_future()
        self.counters.waiting += 1
        try:
            while not mine.done():
                granted, wait = budget.next_grant(self._clock())
                if granted is not None:
                    self._granted.pop(id(granted)).set_result(None)
                    continue
                if on_wait is not None:
                    await on_wait()
                    on_wait = None
                    continue  # the budget may have moved while it ran
                await asyncio.wait({mine}, timeout=wait if wait > 0 else None)
        except BaseException:
            if not mine.done():
                budget.cancel(ticket)
            self._granted.pop(id(ticket), None)
            raise
        finally:
            self.counters.waiting -= 1
        waited = self._clock() - started
        self.counters.grants += 1
        self.counters.waited_s += waited
        self.counters.longest_wait_s = max(self.counters.longest_wait_s, waited)
        return waited

    def wait_estimate(self, provider: str, model: str, tokens: int) -> float:
        """About how many seconds a call of ``tokens`` asked now would wait (0: no budget)."""
        budget = self.budget(provider, model)
        return 0.0 if budget is None else budget.wait_estimate(tokens, self._clock())

    def settle(self, provider: str, model: str, estimated: int, reported: int, *,
               tenant: str = "") -> None:
        budget = self.budget(provider, model)
        if budget is not None:
            budget.settle(estimated, reported, self._clock(), tenant=tenant)

    def retry_after(self, provider: str, model: str, seconds: float) -> None:
        budget = self.budget(provider, model)
        if budget is not None:
            budget.retry_after(seconds, self._clock())

    def observe(self, provider: str, model: str, signal: RateSignal) -> None:
        """A provider's ``x-ratelimit-*`` headers (any call's, refused or not)."""
        budget = self.budget(provider, model)
        if budget is not None:
            observe(budget, signal, self._clock())

    def reshare(self, share: float) -> None:
        """This driver's new part of the fleet's limits (its partitions over all)."""
        if share <= 0 or share == self.share:
            return
        self.share = share
        for budget in self._budgets.values():
            if budget is not None:
                budget.reshare(share, self._clock())
