"""What a turn machine needs to know of a session's past, read from its log.

A driver that takes over a session (restart, rebalance) has nothing but the log: the last turn
number, the last logged request header, the last applied configuration (a
``dsh-pipeline/config`` event, :mod:`pipeline.core.turn_config`) and whether a header stated
it since, the inbox lists (every change of them is an ``agent/inbox/spliced`` event) and the
ids of the messages and configure commands that already entered the session (so a
redelivered inbox record is not applied twice), and the approvals (:mod:`pipeline.core.approvals`).

A splice this driver cannot apply (another writer's shape, indices that do not fit the lists)
is skipped: a session must stay runnable whatever plugins wrote into its log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pipeline.core.approvals import ApprovalBook
from pipeline.core.errors import EventError
from pipeline.core.events import Event, JsonValue
from pipeline.core.inbox import SPLICE_TYPE, InboxLists
from pipeline.core.turn_config import CONFIG_TYPE, configured_header


@dataclass(slots=True)
class History:
    last_turn: int = 0
    header: dict[str, JsonValue] | None = None
    inbox: InboxLists = field(default_factory=InboxLists)
    message_ids: set[str] = field(default_factory=set)
    configured: dict[str, JsonValue] | None = None  # header of the last config event
    configured_last: bool = False  # ... and no request/header came after it
    configure_ids: set[str] = field(default_factory=set)
    approvals: ApprovalBook = field(default_factory=ApprovalBook)


def scan_history(events: Iterable[Event]) -> History:
    """One pass over a log: O(number of events)."""
    history = History()
    for event in events:
        data = event.data
        if event.type.startswith(("approval/", "dsh-pipeline/", "turn/end")):
            history.approvals.advance(event)
        if event.type == "turn/start" and isinstance(data, Mapping):
            turn = data.get("turn")
            if isinstance(turn, int) and turn > history.last_turn:
                history.last_turn = turn
        elif event.type == "request/header" and isinstance(data, Mapping):
            header = data.get("header")
            if isinstance(header, dict):
                history.header = header
                history.configured_last = False
        elif event.type == CONFIG_TYPE:
            found = configured_header(data)
            if found is not None:
                history.configure_ids.add(found[0])
                history.configured, history.configured_last = found[1], True
        elif event.type == SPLICE_TYPE:
            try:
                history.inbox.apply_splice(data, seq=event.seq)
            except EventError:  # plugin data is carried, not trusted: skip what does not fit
                continue
            for message in data.get("inserted", []):
                if isinstance(message, Mapping) and isinstance(message.get("id"), str):
                    history.message_ids.add(message["id"])
    return history
