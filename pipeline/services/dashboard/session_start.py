"""Where a session page starts: the session's derived messages and fleet row, and the offset
of the session topic from which its live events follow.

With ``DSH_DASHBOARD_PROCESSORS_URL`` set, the processors worker that owns the session's
partition answers first (``GET /sessions/{id}/page``, :mod:`pipeline.services.processors.
session_page`): the live surface from its tables, the seq the session expects next, and its
committed offset of the partition, below which every event is in that answer. The page
then reads only the session topic from there: no derived record, so the page costs the
session and the worker's uncommitted lag, not the sessions on the topic (basis
``processors``, expecting exactly that next seq). When the worker cannot vouch for an
answer (recovering, no committed offset yet, moved), or cannot be reached, the page says
why (``processorsRefused``) and starts as follows instead.

The derived messages come from the active ``derived-messages`` version (the projection
pointer says which), read to its end offsets; only the session's slot keys are decoded. A
version with the ``session`` layout holds them in the session's own partition, and only
that partition is read; one with the ``key`` layout (written before layouts existed; a
``replay`` rebuilds it with the session layout) is read whole. Each
record carries its source position (``dsh.source.*``): the session-topic offset of the event
whose change it is. The page's events then follow from the offset after the latest of them,
so every event after the snapshot is sent once and none before it is fetched:

- derived records with a source position: from ``position.offset + 1``, expecting the seq
  after the last change seq (``at_seq + 1``);
- none (a session without a surface message yet, or a version rebuilt by an older replay
  without the headers): from the fleet row's source position + 1, whatever seq comes first;
- no row either: from where the dashboard's live tail started (the session is new).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pipeline.adapters.kafka.compacted import CompactedFollow
from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.adapters.kafka.projection_pointer import active_derived_layout
from pipeline.adapters.processors_web import ProcessorsWeb
from pipeline.codec.output_views import DerivedView
from pipeline.codec.records import SourcePosition, record_key
from pipeline.core.errors import TransportError
from pipeline.core.events import JsonValue
from pipeline.core.projection import Layout
from pipeline.services.dashboard.service import DashboardService


@dataclass(slots=True)
class SessionStart:
    """A session page's snapshot and where its live events continue."""

    session_id: str
    version: int
    topic: str
    layout: Layout = "key"   # "session": only the session's partition was read
    nodes: list[list[int]] = field(default_factory=list)       # [slot, seq], surface order
    messages: dict[int, JsonValue | None] = field(default_factory=dict)  # slot -> message
    at_seq: int = -1
    partition: int = 0
    from_offset: int | None = None   # None: follow the live tail only
    basis: str = "live"   # "processors", "derived", "fleet" or "live": what from_offset
    #                       came from ("processors": the owning worker's tables, no topic read)
    processors_refused: str | None = None  # why the processors' answer was not used
    row: dict[str, JsonValue] | None = None
    records_read: int = 0
    undecodable: int = 0
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, JsonValue]:
        return {"session": self.session_id, "version": self.version, "topic": self.topic,
                "layout": self.layout,
                "atSeq": self.at_seq, "partition": self.partition,
                "fromOffset": self.from_offset, "basis": self.basis, "row": self.row,
                "processorsRefused": self.processors_refused,
                "messages": [self.messages[slot] for slot, _ in self.nodes
                             if self.messages.get(slot) is not None],
                "seqs": [seq for slot, seq in self.nodes
                         if self.messages.get(slot) is not None],
                "recordsRead": self.records_read, "undecodable": self.undecodable,
                "problems": list(self.problems)}


async def session_start(service: DashboardService, session_id: str) -> SessionStart:
    """Read the session's snapshot (see the module doc)."""
    settings = service.settings
    # The pointer is read while the processors are asked: a page waits for one, not both.
    pointer = asyncio.create_task(active_derived_layout(settings))
    start = SessionStart(session_id, -1, "",
                         partition=partition_for(session_id, settings.partitions))
    row = service.model.rows.get(session_id)
    start.row = row.to_json() if row is not None else None
    try:
        answered = service.processors_web is not None and \
            await _from_processors(service.processors_web, start)
    except BaseException:
        pointer.cancel()
        raise
    active, start.layout = await pointer
    start.version, start.topic = active.version, active.topic
    if not answered:
        await _from_derived_topic(service, start)
    return start


async def _from_processors(web: ProcessorsWeb, start: SessionStart) -> bool:
    """The snapshot as the owning processors worker folded it (True), or why not."""
    try:
        body, reason = await web.session_page(start.session_id)
    except TransportError as exc:
        body, reason = None, str(exc)
    page = None if body is None else _page_of(body)
    if page is None:
        start.processors_refused = reason or "its answer is not a session page"
        return False
    nodes, messages, next_seq, partition, from_offset = page
    start.nodes = nodes
    start.messages = {slot: message for (slot, _), message in zip(nodes, messages,
                                                                  strict=True)}
    start.at_seq, start.partition, start.from_offset = next_seq - 1, partition, from_offset
    start.basis = "processors"
    return True


def _page_of(body: dict[str, JsonValue]
             ) -> tuple[list[list[int]], list[JsonValue], int, int, int] | None:
    """The parts of a processors' session page, None when it does not have their shape."""
    nodes, messages = body.get("nodes"), body.get("messages")
    numbers = [n for n in (body.get(name) for name in ("nextSeq", "partition", "fromOffset"))
               if isinstance(n, int) and n >= 0]
    if not isinstance(nodes, list) or not isinstance(messages, list) \
            or len(nodes) != len(messages) or len(numbers) != 3:
        return None
    pairs = [[slot, seq] for slot, seq in
             (node for node in nodes if isinstance(node, list) and len(node) == 2)
             if isinstance(slot, int) and isinstance(seq, int)]
    if len(pairs) != len(nodes):
        return None
    next_seq, partition, from_offset = numbers
    return pairs, messages, next_seq, partition, from_offset


async def _from_derived_topic(service: DashboardService, start: SessionStart) -> None:
    """The snapshot read from the active derived-messages version (see the module doc)."""
    settings, session_id = service.settings, start.session_id
    view = DerivedView(service.outputs)
    prefix = f"{session_id}/".encode()
    only_key = record_key(session_id) if start.layout == "session" else None
    async with CompactedFollow(settings, [start.topic], only_key=only_key) as follow:
        async for batch in follow.snapshot():
            for record in batch:
                if record.key is not None and record.key.startswith(prefix):
                    view.apply(record)
        start.records_read = follow.snapshot_records
    start.undecodable, start.problems = view.undecodable, list(view.problems)
    slots = view.sessions.get(session_id, {})
    for slot in sorted(slots):
        value = view.values[slots[slot]]
        seq, change_seq = value.get("seq"), value.get("changeSeq")
        start.nodes.append([slot, seq if isinstance(seq, int) else -1])
        start.messages[slot] = value.get("message")
        if isinstance(change_seq, int):
            start.at_seq = max(start.at_seq, change_seq)
    row = service.model.rows.get(session_id)
    _position(start, view.positions.get(session_id), row.source if row else None,
              service.tail_start.get(start.partition))


def _position(start: SessionStart, derived: SourcePosition | None,
              fleet: SourcePosition | None, tail: int | None) -> None:
    if derived is not None and start.nodes:
        start.partition, start.from_offset, start.basis = (derived.partition,
                                                           derived.offset + 1, "derived")
    elif fleet is not None:
        start.partition, start.from_offset, start.basis = (fleet.partition, fleet.offset + 1,
                                                           "fleet")
        start.at_seq = -1  # the first event that comes is where the page starts
    else:
        start.from_offset, start.basis, start.at_seq = tail, "live", -1
