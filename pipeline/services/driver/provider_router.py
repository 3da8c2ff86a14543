"""The driver's provider fallback: which route a step's model call takes (the rules:
:mod:`pipeline.core.provider_routes`).

One :class:`ProviderRouter` per driver process, shared by its sessions: a route that failed
for one session is avoided by all of them for its cool-off (a fleet's drivers each learn it
on their own, from their own calls). Its clock is monotonic seconds, as the gate's; how long
a route's rate budget would make a call wait comes from the :class:`ProviderGate`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.core.errors import ProviderError
from pipeline.core.model import ModelRequest
from pipeline.core.provider_routes import (
    Fallbacks,
    Route,
    RouteChoice,
    RouteHealth,
    choose_route,
    leaves_route,
)
from pipeline.core.rate_budget import estimated_tokens
from pipeline.core.turn_effects import ChooseRoute
from pipeline.core.turn_machine import TurnMachine
from pipeline.services.driver.provider_gate import ProviderGate

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RouterCounters:
    """Calls moved to a fallback after a failure, and steps that started on one."""

    failovers: int = 0
    fallback_steps: int = 0


class ProviderRouter:
    """Chooses routes from ``fallbacks``; ``gate`` (if any) says how long each would wait."""

    def __init__(self, fallbacks: Fallbacks, *, gate: ProviderGate | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fallbacks = fallbacks
        self.health = RouteHealth(fallbacks.policy)
        self.counters = RouterCounters()
        self._gate = gate
        self._clock = clock

    def choose(self, primary: Route, tokens: Callable[[], int]) -> RouteChoice:
        """The route a step's call takes; ``tokens()``: its estimated input tokens."""
        chain = self.fallbacks.chain(primary)
        if len(chain) == 1:
            return RouteChoice(primary, "primary")
        choice = choose_route(chain, self.health, self._clock(), self._waiter(tokens))
        assert choice is not None  # the chain is not empty
        if choice.route != primary:
            self.counters.fallback_steps += 1
        return choice

    def after_failure(self, route: Route, primary: Route, error: ProviderError, *,
                      will_retry: bool) -> Route | None:
        """The route to move to after ``error`` on ``route`` (None: stay, retry or end)."""
        chain = self.fallbacks.chain(primary)
        if len(chain) == 1 or not leaves_route(error.code, error.retry_after_ms,
                                                   will_retry=will_retry,
                                                   policy=self.fallbacks.policy):
            return None
        now = self._clock()
        retry_after = None if error.retry_after_ms is None else error.retry_after_ms / 1000
        until = self.health.failed(route, now, retry_after)
        choice = choose_route(chain, self.health, now, self._waiter(lambda: 0), exclude=route)
        if choice is None or self.health.avoided(choice.route, now):
            return None  # every other route failed lately too: the turn ends with the error
        self.counters.failovers += 1
        log.info("provider %s failed (%s): avoided for %.0f s, the call moves to %s",
                 route.key, error.code, until - now, choice.route.key)
        return choice.route

    def answered(self, request: ModelRequest) -> None:
        """The request's route answered: it is not avoided any more."""
        self.health.answered(Route(request.provider, request.model))

    # -- what a session runner calls -------------------------------------------------------

    def route_step(self, machine: TurnMachine, effect: ChooseRoute, now_ms: int) -> None:
        """Answer the machine's :class:`ChooseRoute` (the step's route is logged by it)."""
        def tokens() -> int:
            config = machine.config
            system = config.system if config is not None else None
            return estimated_tokens(machine.log.messages(), system)
        choice = self.choose(Route(effect.provider, effect.model), tokens)
        machine.route_chosen(choice.route.provider, choice.route.model, choice.reason, now_ms)

    def fallback_for(self, machine: TurnMachine, request: ModelRequest,
                     error: ProviderError) -> Route | None:
        """Where the machine's failed ``request`` moves to (None: it retries or ends)."""
        config = machine.config
        if config is None:
            return None
        return self.after_failure(Route(request.provider, request.model),
                                  Route(config.provider, config.model), error,
                                  will_retry=machine.would_retry(error))

    def _waiter(self, tokens: Callable[[], int]) -> Callable[[Route], float]:
        gate = self._gate
        if gate is None:
            return lambda _route: 0.0
        counted: list[int] = []

        def wait(route: Route) -> float:
            if gate.budget(route.provider, route.model) is None:
                return 0.0
            if not counted:
                counted.append(tokens())
            return gate.wait_estimate(route.provider, route.model, counted[0])
        return wait
