"""The dsh-pipeline consumer SDK: what downstream services import.

Every session event on ``<prefix>session-events``, decoded, as an async iterator::

    from pipeline.sdk import Settings, Start, open_stream

    settings = Settings.from_env()                     # DSH_BOOTSTRAP_SERVERS, ...
    async with open_stream(settings, types={"turn/end"}, group_id="billing",
                           start=Start.COMMITTED) as stream:
        async for record in stream:                    # EventRecord
            print(record.session_id, record.event.seq, record.event.data["reason"])
            await stream.commit(record)                # at-least-once

- ``types``: filtered by the ``dsh.type`` record header; other records are never decoded.
- ``group_id``: a consumer group shares the partitions (and so the sessions) between its
  members; two groups each see every event. None: this process reads every partition.
- ``start``: ``Start.BEGINNING``, ``Start.END``, ``Start.COMMITTED`` (the group's committed
  offset, else the beginning) or ``At(epoch_ms)`` (the first record at or after a time).
- ``dedup`` (default on): a redelivered (session, seq) is skipped; a gap raises
  :class:`SessionGap`.

At-least-once processing with batched commits::

    async def handle(record: EventRecord) -> None: ...
    async with open_stream(settings, group_id="indexer", start=Start.COMMITTED) as stream:
        await process_at_least_once(stream, handle, commit_every=500)

One session caught up from a seq (its partition only, no group)::

    async for event in catch_up(settings, "session-id", from_seq=120):
        ...

The derived conversations (the model-visible messages of every session), from whichever
projection version is active (``dsh-pipeline replay`` switches versions, and the live
processors keep publishing into the active one)::

    conversations = await derived_conversations(settings)   # {session id: [message, ...]}

Snapshot, then live changes, of the processors' compacted outputs (never the session
topic's history): ``follow_fleet``, ``follow_usage``, ``follow_derived``. Each yields one
:class:`Snapshot` first, then one :class:`OutputChange` per record written since::

    async for item in follow_fleet(settings):
        if isinstance(item, Snapshot):
            rows = item.view.values          # {session id: fleet status}, as of the snapshot
        else:
            print(item.key, item.value)      # the new status (None: deleted); item.view is current

The guarantee: the snapshot is every key's last value up to the end offsets taken when the
reader started (read committed), and the changes are exactly the records from those offsets
on, in order per partition: no change is lost or applied twice across the seam, whatever is
written while the snapshot is read. The view (``Snapshot.view``) keeps folding: each change
is applied to it before it is yielded. Records that do not decode are counted
(``view.undecodable``, ``view.problems``) and skipped, never fatal. Every output value
carries ``source`` (``dsh.source.partition`` / ``dsh.source.offset`` headers): the
session-topic position of the last event folded into it; to continue a session from its
derived messages, read its partition from ``source.offset + 1``
(``session_records(..., from_offset=...)``).

The derived output topics (``derived-messages``, ``usage``, ``fleet``) hold Avro records
(``schemas/dsh.DerivedMessageChange.avsc``, ``dsh.UsageRecord``, ``dsh.FleetStatus``);
:class:`OutputDecoder` turns a record value back into the JSON object the HTTP API serves
(usage with the dotted OpenTelemetry names), ``None`` for a tombstone, and raises
:class:`CodecError` for anything else::

    decoder = output_decoder(settings)         # registry ids through DSH_REGISTRY_URL
    status = decoder.decode(record.value)      # (OutputDecoder(): single-object only)

Spilled tool results (docs/large-content.md): a ``tool/result`` whose text was too large
keeps a preview in the log and ``meta.spill`` naming the full text on ``<prefix>spill``::

    for ref in spill_refs(events):                   # SpillRef per spilled tool result
        text = await read_spill(settings, ref)      # the whole text, hash-checked

Tool calls waiting for a person's approval (docs/approvals.md) are in the fleet rows::

    async for item in follow_fleet(settings):
        view = item.view
        for waiting in pending_approvals(view.values):   # PendingApproval, oldest first
            print(waiting.session_id, waiting.tool_name, waiting.call_id, waiting.since_ms)

and :func:`decide_approval` puts a decision on the session's inbox (as ``send --approve``).

To keep your own dedup state across restarts, use :class:`SeqTracker` (``check`` ->
:class:`Delivery` APPLY/DUPLICATE/GAP, then ``applied``) and persist its last seqs with
your results.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Collection, Mapping
from dataclasses import dataclass

from pipeline.adapters.kafka.compacted import CompactedFollow
from pipeline.adapters.kafka.event_stream import (
    At,
    EventRecord,
    EventStream,
    SessionGap,
    Start,
    partition_for,
    process_at_least_once,
    session_events,
    session_records,
)
from pipeline.adapters.kafka.plain_producer import inbox_command_record, send_records
from pipeline.adapters.kafka.projection_pointer import active_derived_messages
from pipeline.adapters.kafka.spill import SpillRef, read_spill, spill_refs
from pipeline.adapters.registry.outputs import output_decoder
from pipeline.codec.avro import EventSerde
from pipeline.codec.output_views import (
    Conversation,
    DerivedView,
    OutputChange,
    OutputView,
)
from pipeline.codec.outputs import (
    FLEET_STATUS,
    USAGE_RECORD,
    OutputDecoder,
    OutputSchemaTable,
)
from pipeline.codec.records import SourcePosition
from pipeline.core.dedup import Delivery, SeqTracker
from pipeline.core.errors import BrokerError, CodecError
from pipeline.core.events import Event
from pipeline.core.events import JsonValue as JsonValue
from pipeline.core.inbox import Approve, Deny
from pipeline.core.projection import ActivePointer
from pipeline.settings import Settings

ActiveVersion = ActivePointer  # ``version`` and ``topic`` (and what a rebuild covered)

__all__ = [
    "ActiveVersion", "At", "CodecError", "Conversation", "Delivery", "DerivedView", "Event",
    "EventRecord", "EventSerde", "EventStream", "OutputChange", "OutputDecoder",
    "OutputSchemaTable", "OutputView", "PendingApproval", "SeqTracker", "SessionGap",
    "Settings", "Snapshot", "SourcePosition", "Start", "active_version", "catch_up",
    "decide_approval", "derived_conversations", "follow_derived", "follow_fleet",
    "follow_usage", "open_stream", "output_decoder", "partition_for", "pending_approvals",
    "process_at_least_once", "session_events", "session_records",
]

_DEFAULT_SERDE: EventSerde | None = None


def _serde() -> EventSerde:
    global _DEFAULT_SERDE
    if _DEFAULT_SERDE is None:
        _DEFAULT_SERDE = EventSerde()
    return _DEFAULT_SERDE


def open_stream(settings: Settings, *, types: Collection[str] | None = None,
                group_id: str | None = None, start: Start | At = Start.BEGINNING,
                dedup: bool = True, serde: EventSerde | None = None) -> EventStream:
    """An :class:`EventStream` of the session topic with the project's Avro decoder."""
    return EventStream(settings, decode=(serde or _serde()).decode, types=types,
                       group_id=group_id, start=start, dedup=dedup)


def catch_up(settings: Settings, session_id: str, *, from_seq: int = 0,
             types: Collection[str] | None = None) -> AsyncIterator[Event]:
    """One session's events from ``from_seq`` to the topic's current end."""
    return session_events(settings, session_id, decode=_serde().decode, from_seq=from_seq,
                          types=types)


async def active_version(settings: Settings) -> ActiveVersion:
    """The derived-messages version readers use: the last switch recorded, else version 0."""
    return await active_derived_messages(settings)


async def derived_conversations(settings: Settings) -> dict[str, list[JsonValue]]:
    """Session id -> derived messages, read from the active projection version."""
    active = await active_version(settings)
    view = DerivedView(output_decoder(settings))
    async with CompactedFollow(settings, [active.topic]) as follow:
        async for batch in follow.snapshot():
            for record in batch:
                view.apply(record)
    return view.conversations()


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The first item of a ``follow_*`` reader: ``view`` as of the end offsets taken at its
    start (``records``: how many records that took). ``view`` keeps folding the changes."""

    view: OutputView
    topic: str
    records: int
    ends: dict[int, int]  # partition -> the end offset the snapshot reached (the seam)


async def follow_fleet(settings: Settings, *, decoder: OutputDecoder | None = None
                       ) -> AsyncIterator[Snapshot | OutputChange]:
    """``<prefix>fleet``: key session id, value its status (see the module doc)."""
    view = OutputView(decoder or output_decoder(settings), FLEET_STATUS)
    async for item in _follow(settings, settings.topics.fleet, view):
        yield item


async def follow_usage(settings: Settings, *, decoder: OutputDecoder | None = None
                       ) -> AsyncIterator[Snapshot | OutputChange]:
    """``<prefix>usage``: keys ``session/<id>``, ``model/...``, ``window/...``."""
    view = OutputView(decoder or output_decoder(settings), USAGE_RECORD)
    async for item in _follow(settings, settings.topics.usage, view):
        yield item


async def follow_derived(settings: Settings, *, decoder: OutputDecoder | None = None
                         ) -> AsyncIterator[Snapshot | OutputChange]:
    """The active derived-messages version: keys ``<session>/<slot>``; the view is a
    :class:`DerivedView` (``conversations()``, ``conversation(session_id)``). Read from the
    version active at the start: after a ``replay`` switch, start a new reader."""
    active = await active_version(settings)
    view = DerivedView(decoder or output_decoder(settings))
    async for item in _follow(settings, active.topic, view):
        yield item


async def _follow(settings: Settings, topic: str, view: OutputView
                  ) -> AsyncIterator[Snapshot | OutputChange]:
    async with CompactedFollow(settings, [topic]) as follow:
        if follow.missing:
            raise BrokerError(f"topic {topic!r} does not exist: start the processors "
                              "(`dsh-pipeline processors`), which create and fill it")
        async for batch in follow.snapshot():
            for record in batch:
                view.apply(record)
        ends = {tp.partition: end for tp, end in follow.ends.items()}
        yield Snapshot(view, topic, follow.snapshot_records, ends)
        async for batch in follow.changes():
            for record in batch:
                change = view.apply(record)
                if change is not None:
                    yield change


__all__ += ["SpillRef", "read_spill", "spill_refs"]


@dataclass(frozen=True, slots=True)
class PendingApproval:
    """A tool call waiting for a person (from a fleet row: ``approval_*``)."""

    session_id: str
    call_id: str
    tool_name: str | None
    since_ms: int | None


def pending_approvals(fleet_rows: Mapping[str, Mapping[str, JsonValue]]
                      ) -> list[PendingApproval]:
    """The calls waiting for approval in fleet rows (``{session id: status}``), oldest first."""
    found = []
    for session_id, row in fleet_rows.items():
        call_id, tool, since = (row.get("approval_call_id"), row.get("approval_tool"),
                                row.get("approval_since_ms"))
        if isinstance(call_id, str):
            found.append(PendingApproval(session_id, call_id,
                                         tool if isinstance(tool, str) else None,
                                         since if isinstance(since, int) else None))
    return sorted(found, key=lambda p: (p.since_ms or 0, p.session_id))


async def decide_approval(settings: Settings, session_id: str, call_id: str, *, approve: bool,
                          reason: str | None = None, by: str | None = None,
                          message_id: str | None = None) -> str:
    """Approve or deny a waiting call (an inbox command); returns its message id. The session
    log says what came of it: ``dsh-pipeline/approval`` (taken) or
    ``dsh-pipeline/approval-refused`` (another decision came first)."""
    kind = Approve if approve else Deny
    source: dict[str, JsonValue] = {"kind": "user"}
    if by is not None:
        source["name"] = by
    command = kind(session_id, message_id or str(uuid.uuid4()), call_id, reason=reason,
                   source=source)
    await send_records(settings, [inbox_command_record(settings, command)])
    return command.message_id
