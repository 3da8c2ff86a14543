"""The session topic read whole, and session events turned into records to publish.

A dsh file's header line (``{"type":"session","version":0,"id",...}``) is not an event, so it
has no record of its own: it travels as the ``dsh.session-header`` record header (compact
JSON) of the session's seq-0 record, which is how ``export`` gives back the very file that
was imported. A session started by the driver has no such header; export then writes the
minimal one. The seq-0 record also carries ``dsh.writer: dsh-file``: the session's events
come from a dsh file, so its importer or shipper is its one writer (``codec/records.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from pipeline.adapters.kafka.records import OutRecord, header_value
from pipeline.adapters.kafka.topic_scan import ScanRecord, TopicScan
from pipeline.codec.records import (
    HEADER_WRITER,
    WRITER_DSH_FILE,
    event_headers,
    record_key,
    session_id_of_key,
)
from pipeline.core.errors import CodecError
from pipeline.core.events import Event, JsonValue, dumps_json
from pipeline.core.lossless import LosslessJsonError, loads_lossless
from pipeline.settings import Settings

SESSION_HEADER: Final = "dsh.session-header"
Decoder = Callable[[bytes], tuple[str, Event]]
Encoder = Callable[[str, Event], bytes]


def minimal_header(session_id: str) -> dict[str, JsonValue]:
    return {"type": "session", "version": 0, "id": session_id}


def session_header_of(headers: Sequence[tuple[str, bytes | None]]) -> dict[str, JsonValue] | None:
    """The file header carried by a seq-0 record, or None."""
    raw = header_value(headers, SESSION_HEADER)
    if raw is None:
        return None
    try:
        value = loads_lossless(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, LosslessJsonError) as exc:
        raise CodecError(f"record header {SESSION_HEADER} is not JSON: {exc}") from None
    return value if isinstance(value, dict) else None


def event_records(topic: str, session_id: str, events: Iterable[Event], encode: Encoder,
                  header: dict[str, JsonValue] | None = None, *,
                  partition: int | None = None) -> list[OutRecord]:
    """Records for ``events`` of a dsh file; the seq-0 record carries ``header`` (the file's
    header line) and the writer mark (the driver leaves the session alone).
    An event's envelope key order travels in the event itself (``Event.key_order``).
    ``partition``: the session's partition when the caller knows it (batched sends), else
    the default partitioner's choice (the same one)."""
    key = record_key(session_id)
    out: list[OutRecord] = []
    for event in events:
        headers = event_headers(event)
        if event.seq == 0:
            headers.append((HEADER_WRITER, WRITER_DSH_FILE))
            if header is not None:
                headers.append((SESSION_HEADER, dumps_json(header).encode("utf-8")))
        out.append(OutRecord(topic, key, encode(session_id, event), tuple(headers), partition))
    return out


@dataclass(slots=True)
class LoggedEvent:
    """An event as found on the topic, with its offset (check reports where things are)."""

    event: Event
    partition: int
    offset: int


@dataclass(slots=True)
class TopicSessions:
    """Every session on the topic: events in topic order (duplicates and gaps kept)."""

    events: dict[str, list[LoggedEvent]] = field(default_factory=dict)
    headers: dict[str, dict[str, JsonValue]] = field(default_factory=dict)
    undecodable: list[str] = field(default_factory=list)
    records: int = 0


async def read_sessions(settings: Settings, decode: Decoder, *,
                        only: Collection[str] | None = None,
                        topic: str | None = None) -> TopicSessions:
    """Decode the whole session topic (or the sessions in ``only``) up to its current end."""
    name = topic or settings.topics.session_events
    wanted = {record_key(s) for s in only} if only is not None else None
    found = TopicSessions()
    async with TopicScan(settings, name) as scan:
        async for run in scan.client_batches():  # read, not kept: no copy
            for record in run:
                found.records += 1
                if wanted is not None and record.key not in wanted:
                    continue
                _add(found, record, decode)
    return found


def _add(found: TopicSessions, record: ScanRecord, decode: Decoder) -> None:
    key_text = record.key.decode("utf-8", "replace") if record.key is not None else None
    where = f"{record.topic}[{record.partition}]@{record.offset} (key {key_text!r})"
    try:
        key = session_id_of_key(record.key)
        if record.value is None:
            raise CodecError("null value (tombstone) on the session topic")
        session_id, event = decode(record.value)
        if session_id != key:
            raise CodecError(f"record key {key!r} differs from the event's session "
                             f"{session_id!r}")
        header = session_header_of(record.headers) if event.seq == 0 else None
    except CodecError as exc:
        found.undecodable.append(f"{where}: {exc}")
        return
    if header is not None:
        found.headers.setdefault(session_id, header)
    found.events.setdefault(session_id, []).append(
        LoggedEvent(event, record.partition, record.offset))
