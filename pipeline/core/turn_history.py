"""What a turn machine needs to know of a session's past, read from its log.

A driver that takes over a session (restart, rebalance) has nothing but the log: the last turn
number, the last logged request header, the inbox lists (every change of them is an
``agent/inbox/spliced`` event) and the ids of the messages that already entered the inbox
(so a redelivered inbox record is not queued twice).

A splice this driver cannot apply (another writer's shape, indices that do not fit the lists)
is skipped: a session must stay runnable whatever plugins wrote into its log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pipeline.core.errors import EventError, TurnError
from pipeline.core.events import Event, JsonValue
from pipeline.core.inbox import SPLICE_TYPE, InboxLists
from pipeline.core.turn_effects import SessionConfig


@dataclass(slots=True)
class History:
    last_turn: int = 0
    header: dict[str, JsonValue] | None = None
    inbox: InboxLists = field(default_factory=InboxLists)
    message_ids: set[str] = field(default_factory=set)


def scan_history(events: Iterable[Event]) -> History:
    """One pass over a log: O(number of events)."""
    history = History()
    for event in events:
        data = event.data
        if event.type == "turn/start" and isinstance(data, Mapping):
            turn = data.get("turn")
            if isinstance(turn, int) and turn > history.last_turn:
                history.last_turn = turn
        elif event.type == "request/header" and isinstance(data, Mapping):
            header = data.get("header")
            if isinstance(header, dict):
                history.header = header
        elif event.type == SPLICE_TYPE:
            try:
                history.inbox.apply_splice(data, seq=event.seq)
            except EventError:  # plugin data is carried, not trusted: skip what does not fit
                continue
            for message in data.get("inserted", []):
                if isinstance(message, Mapping) and isinstance(message.get("id"), str):
                    history.message_ids.add(message["id"])
    return history


def config_from_header(header: Mapping[str, JsonValue]) -> SessionConfig:
    """The configuration a logged ``request/header`` states.

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
