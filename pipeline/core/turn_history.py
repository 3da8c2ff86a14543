"""What a turn machine needs to know of a session's past, read from its log.

A driver that takes over a session (restart, rebalance) has nothing but the log: the last turn
number, the last logged request header, the last applied configuration (a
``dsh-pipeline/config`` event, :mod:`pipeline.core.turn_config`) and whether a header stated
it since, the inbox lists (every change of them is an ``agent/inbox/spliced`` event) and the
ids of the messages and configure commands that already entered the session (so a
redelivered inbox record is not applied twice), the approvals (:mod:`pipeline.core.approvals`)
and the session's tenant (:mod:`pipeline.core.tenants`).

A splice this driver cannot apply (another writer's shape, indices that do not fit the lists)
is skipped: a session must stay runnable whatever plugins wrote into its log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeGuard

from pipeline.core.approvals import ApprovalBook
from pipeline.core.errors import CodecError, EventError
from pipeline.core.events import Event, JsonValue
from pipeline.core.inbox import SPLICE_TYPE, InboxLists
from pipeline.core.provider_routes import ROUTE_TYPE, LoggedRoute, logged_route
from pipeline.core.tenants import DEFAULT_TENANT, TENANT_TYPE, folded_tenant
from pipeline.core.turn_config import CONFIG_TYPE, configured_header


@dataclass(slots=True)
class History:
    """What a machine needs of a session's past, folded event by event (:meth:`advance`).

    Every field is a fold of the events alone (no event is kept), so folding a log in pieces,
    with a trip through :meth:`to_json` / :meth:`from_json` in between, gives the same
    History as one pass over the whole log (:func:`scan_history`).
    """

    last_turn: int = 0
    header: dict[str, JsonValue] | None = None
    inbox: InboxLists = field(default_factory=InboxLists)
    message_ids: set[str] = field(default_factory=set)
    configured: dict[str, JsonValue] | None = None  # header of the last config event
    configured_last: bool = False  # ... and no request/header came after it
    configure_ids: set[str] = field(default_factory=set)
    approvals: ApprovalBook = field(default_factory=ApprovalBook)
    tenant: str = DEFAULT_TENANT  # the first valid tenant event's (pipeline.core.tenants)
    route: LoggedRoute | None = None  # the last dsh-pipeline/route event's

    def advance(self, event: Event) -> None:
        """Fold one event in (O(size of the event))."""
        data = event.data
        if event.type.startswith(("approval/", "dsh-pipeline/", "turn/end")):
            self.approvals.advance(event)
        if event.type == "turn/start" and isinstance(data, Mapping):
            turn = data.get("turn")
            if isinstance(turn, int) and turn > self.last_turn:
                self.last_turn = turn
        elif event.type == "request/header" and isinstance(data, Mapping):
            header = data.get("header")
            if isinstance(header, dict):
                self.header = header
                self.configured_last = False
        elif event.type == CONFIG_TYPE:
            found = configured_header(data)
            if found is not None:
                self.configure_ids.add(found[0])
                self.configured, self.configured_last = found[1], True
        elif event.type == SPLICE_TYPE:
            self._splice(event)
        elif event.type == TENANT_TYPE:
            self.tenant = folded_tenant(self.tenant, data)
        elif event.type == ROUTE_TYPE:
            self.route = logged_route(data)

    def _splice(self, event: Event) -> None:
        data = event.data
        try:
            self.inbox.apply_splice(data, seq=event.seq)
        except EventError:  # plugin data is carried, not trusted: skip what does not fit
            return
        for message in data.get("inserted", []):
            if isinstance(message, Mapping) and isinstance(message.get("id"), str):
                self.message_ids.add(message["id"])

    def to_json(self) -> dict[str, JsonValue]:
        """Every field (id sets sorted, so equal Histories give equal JSON; ``route`` only
        when a route event was logged)."""
        raw: dict[str, JsonValue] = {
            "lastTurn": self.last_turn, "header": self.header, "inbox": self.inbox.to_json(),
            "messageIds": sorted(self.message_ids), "configured": self.configured,
            "configuredLast": self.configured_last,
            "configureIds": sorted(self.configure_ids), "approvals": self.approvals.to_json(),
            "tenant": self.tenant}
        if self.route is not None:
            raw["route"] = self.route.to_json()
        return raw

    @classmethod
    def from_json(cls, raw: JsonValue) -> History:
        """The History :meth:`to_json` gave, in fresh containers (headers are copied one
        level deep: the machine replaces them, never edits them); :class:`CodecError` if a
        field does not fit."""
        if not isinstance(raw, Mapping):
            raise CodecError("a session history must be a JSON object")
        last_turn, header, configured = raw.get("lastTurn"), raw.get("header"), \
            raw.get("configured")
        ids, configure_ids = raw.get("messageIds"), raw.get("configureIds")
        if type(last_turn) is not int or not _optional_object(header) \
                or not _optional_object(configured) \
                or not isinstance(raw.get("configuredLast"), bool) \
                or not _strings(ids) or not _strings(configure_ids) \
                or not isinstance(raw.get("tenant", DEFAULT_TENANT), str):
            raise CodecError("a session history needs an integer lastTurn, header and "
                             "configured (objects or null), a boolean configuredLast and "
                             "messageIds and configureIds (lists of strings), and a string "
                             "tenant when present")
        return cls(last_turn=last_turn, header=_copy(header),
                   inbox=InboxLists.from_json(raw.get("inbox")), message_ids=set(ids),
                   configured=_copy(configured), configured_last=raw["configuredLast"],
                   configure_ids=set(configure_ids),
                   approvals=ApprovalBook.from_json(raw.get("approvals")),
                   tenant=str(raw.get("tenant", DEFAULT_TENANT)),
                   route=_route(raw.get("route")))



def _route(raw: JsonValue) -> LoggedRoute | None:
    """A checkpoint's route (absent in checkpoints written before fallbacks existed)."""
    if raw is None:
        return None
    route = logged_route(raw)
    if route is None:
        raise CodecError("a session history's route must be {provider, model, primary}")
    return route


def _optional_object(value: JsonValue) -> bool:
    return value is None or isinstance(value, dict)


def _strings(value: JsonValue) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _copy(value: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
    return None if value is None else dict(value)


def scan_history(events: Iterable[Event]) -> History:
    """One pass over a log: O(number of events)."""
    history = History()
    for event in events:
        history.advance(event)
    return history
