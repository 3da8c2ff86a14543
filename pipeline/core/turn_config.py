"""A session's model configuration, and how the log keeps it.

A ``configure`` command changes the configuration (provider, model, system prompt, tools,
reasoning effort, max tokens) of every later model request. The log must say so the moment
the command is applied, not only when a ``request/header`` states it at the next model
request: the driver commits the command's inbox offset once the command is applied, so a
configuration that lived only in a driver's memory would be lost by a crash (or any rebuild)
before the next turn.

So an applied configure appends one extension event, :data:`CONFIG_TYPE`, marked
``ignorable: true`` (DESIGN.md section 1: a reader that does not know the type skips it; it
is never on the surface and projects to no message)::

    {"type": "dsh-pipeline/config", "ignorable": true,
     "data": {"messageId": "<the configure's id>",
              "header": {"config": {"provider", "model", "reasoningEffort"?, "maxTokens"?},
                         "system"?, "tools"?}}}

``data.header`` is the *whole* configuration in force after the command (not the fields it
changed), in exactly the shape of ``request/header``'s ``data.header``, so a rebuild takes the
last one as it is, and the next ``request/header`` must state the same header (checked at
run time: :meth:`ConfigState.header_due`). It holds no secret: a configuration names a
provider and a model; credentials belong to the driver's settings, never to a command or the
log. ``messageId`` lets a re-delivered configure be recognised from the log alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Final

from pipeline.core.errors import InvariantViolation, TurnError
from pipeline.core.events import Event, JsonValue
from pipeline.core.inbox import Configure
from pipeline.core.provider_routes import (
    ROUTE_TYPE,
    LoggedRoute,
    Route,
    header_route,
    logged_route,
    routed_header,
)
from pipeline.core.turn_effects import SessionConfig

CONFIG_TYPE: Final = "dsh-pipeline/config"


def config_from_header(header: Mapping[str, JsonValue]) -> SessionConfig:
    """The configuration a logged ``request/header`` (or config event) states.

    A ``tools`` value that is not a list (the fixtures' ``"{{tools}}"`` placeholder) is not a
    set of definitions: it maps to None, so the next request logs a header of its own.
    """
    config = header.get("config")
    if not isinstance(config, Mapping) or not isinstance(config.get("provider"), str) \
            or not isinstance(config.get("model"), str):
        raise TurnError("request/header has no config.provider/config.model strings")
    system = header.get("system")
    tools = header.get("tools")
    effort = config.get("reasoningEffort")
    max_tokens = config.get("maxTokens")
    return SessionConfig(
        provider=config["provider"], model=config["model"],
        system=system if isinstance(system, str) else None,
        tools=tuple(tools) if isinstance(tools, list) else None,
        reasoning_effort=effort if isinstance(effort, str) else None,
        max_tokens=max_tokens if isinstance(max_tokens, int) else None)


def config_event_data(message_id: str, header: dict[str, JsonValue]) -> dict[str, JsonValue]:
    """The ``data`` of the :data:`CONFIG_TYPE` event of an applied configure."""
    return {"messageId": message_id, "header": header}


def configured_header(data: JsonValue) -> tuple[str, dict[str, JsonValue]] | None:
    """``(message id, header)`` of a config event's data; None when it does not fit.

    Only a header this module would write counts (one that round-trips through
    :class:`SessionConfig`); another writer's data under this type is carried, not trusted
    (as a splice that does not fit): a session must stay runnable whatever is in its log.
    """
    if not isinstance(data, Mapping):
        return None
    message_id, header = data.get("messageId"), data.get("header")
    if not isinstance(message_id, str) or not isinstance(header, dict):
        return None
    try:
        if config_from_header(header).header() != header:
            return None
    except TurnError:
        return None
    return message_id, header


def _usable_config(header: Mapping[str, JsonValue] | None) -> SessionConfig | None:
    if header is None:
        return None
    try:
        return config_from_header(header)
    except TurnError:  # a header without provider/model strings: not a usable config
        return None


class ConfigState:
    """The machine's view of the configuration, rebuilt from the log.

    ``config``: what the next model request uses; ``header``: the last logged
    ``request/header`` (what the model was last asked with); ``configured``: the header of
    the last config event, which every later ``request/header`` must state, but for the
    provider and model when ``route`` (a fallback, :mod:`pipeline.core.provider_routes`)
    stands in for the configured ones.
    """

    def __init__(self, *, header: dict[str, JsonValue] | None,
                 configured: dict[str, JsonValue] | None, configured_last: bool,
                 message_ids: set[str], default: SessionConfig | None,
                 route: LoggedRoute | None = None) -> None:
        """``configured_last``: the config event came after the last ``request/header``;
        ``route``: the last ``dsh-pipeline/route`` event's.

        The newer of the two wins: a config event not yet stated by a header is the
        configuration in force; else the logged header (with the configured provider and
        model back if the route event says the header names a fallback), else the caller's
        ``default``.
        """
        self.header = header
        self.message_ids = message_ids
        self.configured = configured if configured_last else None
        self.route: Route | None = None
        if route is not None and route.is_fallback and header_route(header) == route.route:
            self.route = route.route
        newest = self.configured if self.configured is not None else header
        config = _usable_config(newest)
        if config is not None and self.configured is None and self.route is not None:
            assert route is not None
            config = dataclasses.replace(config, provider=route.primary.provider,
                                         model=route.primary.model)
        self._set(config or default)
        self._routed: tuple[dict[str, JsonValue], Route, dict[str, JsonValue]] | None = None
        if header is None:
            self.header_reason = "initial"
        else:  # a configure not yet stated by a header is a change, as before the rebuild
            self.header_reason = "change" if self.configured is not None else "resume"
        self._request_config: tuple[dict[str, JsonValue], SessionConfig] | None = None

    def _set(self, config: SessionConfig | None) -> None:
        self.config = config
        self._config_header = config.header() if config is not None else None

    def configure(self, command: Configure, tools: tuple[JsonValue, ...] | None
                  ) -> dict[str, JsonValue]:
        """Apply ``command``; the data of the config event to append (nothing changes if it
        is refused). ``tools`` are the resolved definitions of its tool names."""
        if command.tools is not None and (tools is None or len(tools) != len(command.tools)):
            raise TurnError(f"configure {command.message_id!r} names tools "
                            f"{list(command.tools)}: pass their resolved definitions")
        self._set(SessionConfig.configured(self.config, command, tools))
        assert self._config_header is not None
        self.configured = self._config_header
        self.message_ids.add(command.message_id)
        if self.header is not None:
            self.header_reason = "change"
        return config_event_data(command.message_id, self._config_header)

    def header_due(self) -> tuple[dict[str, JsonValue], str] | None:
        """``(header, reason)`` when the next request needs a new ``request/header``, else
        None; the header is then taken as logged. Refuses a header that differs from the
        last config event (``InvariantViolation``: a bug)."""
        header = self._config_header
        if header is None:
            raise TurnError("no provider/model configured for this session")
        configured = self.configured
        if configured is not None and configured is not header:
            if configured != header:
                raise InvariantViolation(
                    f"the next request header (config {header.get('config')}) differs from "
                    f"the last logged configuration (config {configured.get('config')})")
            self.configured = header  # equal: later checks are an identity test
        header = self._routed_header(header)
        if header is self.header or header == self.header:
            return None
        reason, self.header, self.header_reason = self.header_reason, header, "change"
        return header, reason

    @property
    def primary(self) -> Route | None:
        """The configured provider/model (what a route stands in for)."""
        return None if self.config is None else Route(self.config.provider, self.config.model)

    def set_route(self, route: Route | None) -> None:
        """The route the next header names (None or the primary: the configured one)."""
        self.route = None if route == self.primary else route

    def _routed_header(self, header: dict[str, JsonValue]) -> dict[str, JsonValue]:
        route = self.route
        if route is None or route == self.primary:
            return header
        cached = self._routed
        if cached is None or cached[0] is not header or cached[1] != route:
            cached = self._routed = (header, route, routed_header(header, route))
        return cached[2]

    def request_config(self) -> SessionConfig:
        """What the last logged ``request/header`` states (read once per header)."""
        if self.header is None:
            raise TurnError("no request/header has been logged yet")
        if self._request_config is None or self._request_config[0] is not self.header:
            self._request_config = (self.header, config_from_header(self.header))
        return self._request_config[1]


def config_disagreements(events: Iterable[Event]) -> list[str]:
    """Where a log's ``request/header`` differs from the config event before it.

    After a :data:`CONFIG_TYPE` event every ``request/header`` must state its header, until
    the next config event; but for the provider and model when the last route event before
    it says a fallback of the configured ones stands in. Empty for a log this driver wrote;
    for ``check``-style tools.
    """
    problems: list[str] = []
    configured: tuple[int, dict[str, JsonValue]] | None = None
    route: LoggedRoute | None = None
    for event in events:
        if event.type == CONFIG_TYPE:
            found = configured_header(event.data)
            if found is not None:
                configured = (event.seq, found[1])
        elif event.type == ROUTE_TYPE:
            route = logged_route(event.data)
        elif event.type == "request/header" and configured is not None:
            data = event.data
            header = data.get("header") if isinstance(data, Mapping) else None
            if header != configured[1] and not _routed_from(header, configured[1], route):
                problems.append(f"seq {event.seq}: request/header differs from the "
                                f"configuration logged at seq {configured[0]}")
    return problems


def _routed_from(header: JsonValue, configured: dict[str, JsonValue],
                 route: LoggedRoute | None) -> bool:
    """``header`` is ``configured`` with a fallback of its provider/model in their place."""
    return (route is not None and route.is_fallback
            and route.primary == header_route(configured)
            and header == routed_header(configured, route.route))
