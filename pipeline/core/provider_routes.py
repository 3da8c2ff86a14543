"""Provider fallback (issue 30): which provider/model route answers a model call.

Pure and synchronous: time is a number the caller passes (``now``, seconds on a monotonic
clock), and how long a route's rate budget would make a call wait is a function the caller
passes. The driver's :mod:`pipeline.services.driver.provider_router` performs the I/O.

A *route* is dsh's name for a provider/model pair (dsh records "the assistant route": the
``provider`` and ``model`` of the request on the answer's ``source``). A model may name
*fallbacks*, routes tried in order while it fails or is over budget (``DSH_PROVIDER_FALLBACKS``).
dsh itself has no failover (its retries keep "the same explicit provider/model request"), so
a fallback is logged with dsh's own vocabulary: the session's ``request/header`` changes
(reason ``change``, as when dsh's ``agent/request`` replaces the provider/model pair), and the
``assistant/message`` source names the route that answered. One extension event,
:data:`ROUTE_TYPE` (ignorable), says why and which configured route it stands in for, so a
rebuild of the session knows its configured model::

    {"type": "dsh-pipeline/route", "ignorable": true,
     "data": {"provider": "backup", "model": "gpt-4o-mini", "reason": "failed",
              "primary": {"provider": "deepseek", "model": "deepseek-chat"}}}

Rules kept here:

- **Leaving a route after a failure** (:func:`leaves_route`): only failures that say the
  provider cannot serve now (:data:`FAILOVER_CODES`), once the turn's retry policy would not
  retry on this route any more, or at once for a ``429`` whose ``Retry-After`` is longer than
  ``max_wait_s``. A request the provider refuses as bad (context window, bad request, auth)
  ends the turn as before: another model would not make it right.
- **Avoiding a failed route** (:class:`RouteHealth`, a circuit breaker): a route left after a
  failure is avoided for ``cool_off_s``, doubled at each consecutive failure up to
  ``max_cool_off_s``, and never less than the provider's ``Retry-After``. Then it is tried
  again by the next call that would use it; an answer resets it.
- **Choosing** (:func:`choose_route`): the first route of the chain (the model, then its
  fallbacks) that is not avoided and whose budget would grant within ``max_wait_s``; when every
  available route would wait longer, the one that waits least; when every route is avoided,
  the one avoided until the soonest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from pipeline.core.errors import ConfigError
from pipeline.core.events import JsonValue

ROUTE_TYPE: Final = "dsh-pipeline/route"
FAILOVER_CODES: Final = frozenset({"RATE_LIMIT", "OVERLOADED", "SERVER", "NETWORK",
                                   "TIMEOUT", "QUOTA"})
REASONS: Final = frozenset({"primary", "failed", "over-budget"})
POLICY_KEY: Final = "policy"


@dataclass(frozen=True, slots=True)
class Route:
    """A provider and a model (``provider/model``: the provider name has no ``/``)."""

    provider: str
    model: str

    @property
    def key(self) -> str:
        return f"{self.provider}/{self.model}"

    @classmethod
    def parse(cls, text: object, where: str) -> Route:
        """``provider/model`` (the model may hold ``/``); ConfigError naming ``where``."""
        if not isinstance(text, str) or "/" not in text:
            raise ConfigError(f"{where} must be a string provider/model, got {text!r}")
        provider, _, model = text.partition("/")
        if not provider or not model:
            raise ConfigError(f"{where} must be provider/model with both parts, got {text!r}")
        return cls(provider, model)

    def to_json(self) -> dict[str, JsonValue]:
        return {"provider": self.provider, "model": self.model}


@dataclass(frozen=True, slots=True)
class FailoverPolicy:
    """The bounds: how long a call may wait for a route, how long a failed one is avoided."""

    max_wait_s: float = 10.0
    cool_off_s: float = 30.0
    max_cool_off_s: float = 600.0

    def __post_init__(self) -> None:
        if not (self.max_wait_s >= 0 and 0 < self.cool_off_s <= self.max_cool_off_s):
            raise ConfigError("provider fallback policy needs max_wait_s >= 0 and 0 < "
                              f"cool_off_s <= max_cool_off_s, got {self.max_wait_s}, "
                              f"{self.cool_off_s}, {self.max_cool_off_s}")


@dataclass(frozen=True, slots=True)
class Fallbacks:
    """``DSH_PROVIDER_FALLBACKS``: each model's fallback routes in order, and the policy."""

    routes: Mapping[Route, tuple[Route, ...]] = field(default_factory=dict)
    policy: FailoverPolicy = field(default_factory=FailoverPolicy)

    def chain(self, primary: Route) -> tuple[Route, ...]:
        """The model, then its fallbacks."""
        return (primary, *self.routes.get(primary, ()))

    def providers(self) -> set[str]:
        """Every provider the fallbacks name (keys and routes)."""
        return {r.provider for key, chain in self.routes.items() for r in (key, *chain)}


# -- the configuration ----------------------------------------------------------------------

FALLBACKS_EXAMPLE: Final = ('{"deepseek/deepseek-chat": ["backup/gpt-4o-mini"], '
                            '"policy": {"max_wait_s": 10, "cool_off_s": 30}}')
_POLICY_FIELDS: Final = ("max_wait_s", "cool_off_s", "max_cool_off_s")


def parse_fallbacks(raw: object, *, known_providers: set[str] | frozenset[str] | None = None
                    ) -> Fallbacks:
    """The fallbacks of a decoded ``DSH_PROVIDER_FALLBACKS`` JSON object; ConfigError naming
    the entry that is wrong. ``known_providers``: every route must name one of them."""
    name = "DSH_PROVIDER_FALLBACKS"
    if not isinstance(raw, dict):
        raise ConfigError(f"{name} must be a JSON object, e.g. {FALLBACKS_EXAMPLE}")
    routes: dict[Route, tuple[Route, ...]] = {}
    policy = FailoverPolicy()
    for key, value in raw.items():
        if key == POLICY_KEY:
            policy = _policy(value)
            continue
        primary = Route.parse(key, f"{name} key {key!r}")
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{name}[{key!r}] must be a non-empty list of provider/model")
        chain = tuple(Route.parse(item, f"{name}[{key!r}][{n}]")
                      for n, item in enumerate(value))
        if primary in chain or len(set(chain)) != len(chain):
            raise ConfigError(f"{name}[{key!r}] must not repeat a route or name the model "
                              "itself")
        routes[primary] = chain
    fallbacks = Fallbacks(routes, policy)
    if known_providers is not None:
        unknown = sorted(fallbacks.providers() - set(known_providers))
        if unknown:
            raise ConfigError(f"{name} names unknown provider(s) {', '.join(map(repr, unknown))}"
                              f"; known: {', '.join(sorted(known_providers))} (DSH_PROVIDERS "
                              "defines more)")
    return fallbacks


def _policy(raw: object) -> FailoverPolicy:
    where = f'DSH_PROVIDER_FALLBACKS["{POLICY_KEY}"]'
    if not isinstance(raw, dict) or not set(raw) <= set(_POLICY_FIELDS):
        raise ConfigError(f"{where} must be an object of {', '.join(_POLICY_FIELDS)}")
    values: dict[str, float] = {}
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{where}.{key} must be a number of seconds >= 0, got {value!r}")
        values[key] = float(value)
    try:
        return FailoverPolicy(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


# -- the decisions --------------------------------------------------------------------------


def leaves_route(code: str, retry_after_ms: int | None, *, will_retry: bool,
                 policy: FailoverPolicy) -> bool:
    """Whether a failure makes the call leave its route for the next one."""
    if code not in FAILOVER_CODES:
        return False
    if retry_after_ms is not None and retry_after_ms > policy.max_wait_s * 1000:
        return True  # the provider asks for a longer wait than a call may wait
    return not will_retry


@dataclass(slots=True)
class _Health:
    failures: int = 0
    avoid_until: float = 0.0


class RouteHealth:
    """Which routes are avoided after failing, until when (a circuit breaker per route)."""

    def __init__(self, policy: FailoverPolicy) -> None:
        self.policy = policy
        self._routes: dict[Route, _Health] = {}

    def avoided_until(self, route: Route) -> float:
        health = self._routes.get(route)
        return 0.0 if health is None else health.avoid_until

    def avoided(self, route: Route, now: float) -> bool:
        return self.avoided_until(route) > now

    def failed(self, route: Route, now: float, retry_after_s: float | None = None) -> float:
        """The route was left after a failure: avoided until the returned time."""
        health = self._routes.setdefault(route, _Health())
        cool_off = min(self.policy.max_cool_off_s,
                       self.policy.cool_off_s * 2 ** min(health.failures, 32))
        health.failures += 1
        health.avoid_until = now + max(cool_off, retry_after_s or 0.0)
        return health.avoid_until

    def answered(self, route: Route) -> None:
        """The route answered: no longer avoided, its failures forgotten."""
        self._routes.pop(route, None)


@dataclass(frozen=True, slots=True)
class RouteChoice:
    route: Route
    reason: str  # one of REASONS


def choose_route(chain: tuple[Route, ...], health: RouteHealth, now: float,
                 wait_s: Callable[[Route], float], *, exclude: Route | None = None
                 ) -> RouteChoice | None:
    """The route a call takes now (None: ``chain`` has nothing but ``exclude``).

    ``wait_s(route)``: seconds the route's budget would make the call wait (0: none)."""
    candidates = [(n, r) for n, r in enumerate(chain) if r != exclude]
    if not candidates:
        return None
    waits: dict[Route, float] = {}

    def wait(route: Route) -> float:
        if route not in waits:
            waits[route] = wait_s(route)
        return waits[route]

    available = [(n, r) for n, r in candidates if not health.avoided(r, now)]
    for _, route in available:
        if wait(route) <= health.policy.max_wait_s:
            return RouteChoice(route, _reason(chain, route, health, now))
    if available:
        _, route = min(available, key=lambda item: (wait(item[1]), item[0]))
    else:
        _, route = min(candidates, key=lambda item: (health.avoided_until(item[1]), item[0]))
    return RouteChoice(route, _reason(chain, route, health, now))


def _reason(chain: tuple[Route, ...], route: Route, health: RouteHealth, now: float) -> str:
    primary = chain[0]
    if route == primary:
        return "primary"
    return "failed" if health.avoided(primary, now) else "over-budget"


# -- the log --------------------------------------------------------------------------------


def route_event_data(route: Route, primary: Route, reason: str) -> dict[str, JsonValue]:
    """The ``data`` of a :data:`ROUTE_TYPE` event."""
    return {**route.to_json(), "reason": reason, "primary": primary.to_json()}


@dataclass(frozen=True, slots=True)
class LoggedRoute:
    """What a :data:`ROUTE_TYPE` event says: ``route`` now stands in for ``primary``."""

    route: Route
    primary: Route

    @property
    def is_fallback(self) -> bool:
        return self.route != self.primary

    def to_json(self) -> dict[str, JsonValue]:
        return {**self.route.to_json(), "primary": self.primary.to_json()}


def logged_route(data: JsonValue) -> LoggedRoute | None:
    """The route of a :data:`ROUTE_TYPE` event's data (or :meth:`LoggedRoute.to_json`);
    None when it does not fit (another writer's data is carried, not trusted)."""
    if not isinstance(data, Mapping):
        return None
    route, primary = _route_of(data), _route_of(data.get("primary"))
    if route is None or primary is None:
        return None
    return LoggedRoute(route, primary)


def _route_of(data: JsonValue) -> Route | None:
    if not isinstance(data, Mapping):
        return None
    provider, model = data.get("provider"), data.get("model")
    if isinstance(provider, str) and provider and isinstance(model, str) and model:
        return Route(provider, model)
    return None


def routed_header(header: dict[str, JsonValue], route: Route) -> dict[str, JsonValue]:
    """``header`` (a ``request/header`` ``data.header``) with its config naming ``route``."""
    config = header.get("config")
    if not isinstance(config, Mapping):
        raise ConfigError("a request header without a config cannot be routed")
    return {**header, "config": {**config, **route.to_json()}}


def header_route(header: Mapping[str, JsonValue] | None) -> Route | None:
    """The provider/model a header's config names."""
    return None if header is None else _route_of(header.get("config"))
