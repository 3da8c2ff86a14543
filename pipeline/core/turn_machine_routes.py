"""The turn machine's provider routes: which provider/model a step's call takes, and the
move to a fallback after a failure (the rules: :mod:`pipeline.core.provider_routes`).

A machine made with ``routing=True`` asks :class:`ChooseRoute` at each step's start, before
the step's ``request/header``; the caller answers :meth:`RoutesPhase.route_chosen`. A route
other than the one the last header names logs a ``dsh-pipeline/route`` event (ignorable), then
the ``request/header`` naming it (reason ``change``, as any change of provider/model in dsh).
After a failure the caller may pass a fallback to ``stream_failed``: the machine then logs
``llm/retry`` (``delayMs: 0``, ``fallback: {provider, model}``), ``llm/retry-started``, the
route event and the header, and calls the fallback at once, with a retry budget of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.core.errors import ProviderError
from pipeline.core.events import JsonValue
from pipeline.core.model import RetryPolicy, failure_of
from pipeline.core.provider_routes import ROUTE_TYPE, Route, route_event_data
from pipeline.core.turn_config import ConfigState
from pipeline.core.turn_effects import ChooseRoute
from pipeline.core.turn_machine_tools import Phase


class RoutesPhase:
    """The machine's route methods; the attributes and methods below are the machine's."""

    phase: Phase
    _config: ConfigState
    _retry: RetryPolicy
    _turn: int
    _step: int
    _attempt: int
    _route_start: int  # the step's first attempt on the current route

    def _append(self, type_: str, data: JsonValue, now: int, *, surface: bool = False,
                sources: Iterable[int] | None = None, ignorable: bool | None = None) -> int:
        raise NotImplementedError

    def _log_header_if_changed(self, now: int) -> None:
        raise NotImplementedError

    def _reset_attempt(self, attempt: int) -> None:
        raise NotImplementedError

    def _expect(self, phase: Phase, what: str) -> None:
        raise NotImplementedError

    def _ask_route(self) -> ChooseRoute:
        primary = self._config.primary
        assert primary is not None  # hooks_done ended the turn without a configuration
        self.phase = Phase.ROUTING
        return ChooseRoute(primary.provider, primary.model)

    def route_chosen(self, provider: str, model: str, reason: str, now: int) -> None:
        """The step's call takes ``provider/model`` (``reason``: why, for the route event)."""
        self._expect(Phase.ROUTING, "route_chosen")
        self._use_route(Route(provider, model), reason, now)
        self.phase = Phase.CALL

    def would_retry(self, error: ProviderError) -> bool:
        """Whether the retry policy would try the current route again after ``error``."""
        return self._retry.should_retry(self._route_attempt, error)

    @property
    def _route_attempt(self) -> int:
        return self._attempt - self._route_start + 1

    def _fail_over(self, error: ProviderError, fallback: Route, now: int) -> None:
        self._append("llm/retry", {
            "turn": self._turn, "step": self._step, "attempt": self._attempt, "delayMs": 0,
            "error": failure_of(error), "fallback": fallback.to_json()}, now)
        self._reset_attempt(self._attempt + 1)
        self._route_start = self._attempt
        self._append("llm/retry-started", {"turn": self._turn, "step": self._step,
                                           "attempt": self._attempt}, now)
        self._use_route(fallback, "failed", now)
        self.phase = Phase.CALL

    def _use_route(self, route: Route, reason: str, now: int) -> None:
        primary = self._config.primary
        assert primary is not None
        if route != (self._config.route or primary):
            self._append(ROUTE_TYPE, route_event_data(route, primary, reason), now,
                         ignorable=True)
            self._config.set_route(route)
        self._log_header_if_changed(now)
