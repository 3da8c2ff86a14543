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

To keep your own dedup state across restarts, use :class:`SeqTracker` (``check`` ->
:class:`Delivery` APPLY/DUPLICATE/GAP, then ``applied``) and persist its last seqs with
your results.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection

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
from pipeline.adapters.kafka.spill import SpillRef, read_spill, spill_refs
from pipeline.adapters.registry.outputs import output_decoder
from pipeline.codec.avro import EventSerde
from pipeline.codec.outputs import OutputDecoder, OutputSchemaTable
from pipeline.core.dedup import Delivery, SeqTracker
from pipeline.core.errors import CodecError
from pipeline.core.events import Event
from pipeline.core.events import JsonValue as JsonValue
from pipeline.services.replay.compare import read_conversations
from pipeline.services.replay.versions import ActiveVersion, active_version
from pipeline.settings import Settings

__all__ = [
    "ActiveVersion", "At", "CodecError", "Delivery", "Event", "EventRecord", "EventSerde",
    "EventStream", "OutputDecoder", "OutputSchemaTable", "SeqTracker", "SessionGap",
    "Settings", "Start", "active_version", "catch_up", "derived_conversations",
    "open_stream", "output_decoder", "partition_for", "process_at_least_once", "session_events",
    "session_records",
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


async def derived_conversations(settings: Settings) -> dict[str, list[JsonValue]]:
    """Session id -> derived messages, read from the active projection version."""
    active = await active_version(settings)
    return await read_conversations(settings, active.topic) or {}


__all__ += ["SpillRef", "read_spill", "spill_refs"]
