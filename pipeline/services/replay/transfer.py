"""Import dsh session files into the session topic, and export a session back to a file.

Import is idempotent and all-or-nothing per file:

1. the importer's transactional producer starts first, which fences any earlier importer
   and aborts its open transaction (one transactional id for all importers of a prefix);
2. the session's events already on the topic are read (read committed, so what the fenced
   importer left half-done is invisible);
3. every event the topic already holds must equal the file's event at that seq, or the file is
   refused (:class:`~pipeline.core.errors.EventError`, rule ``import-conflict``) before
   anything is sent;
4. the rest of the file is published in one transaction: a crash leaves all or nothing.

Export reads the session (its partition only) and writes header + events, packed as dsh
writes its files, so export(import(x)) == x byte for byte for a file dsh wrote.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.adapters.kafka.event_stream import session_records
from pipeline.adapters.kafka.spill import read_spill, spill_refs
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.codec.sessionfile import encode_lines, load_session, write_session_file
from pipeline.core.errors import ConfigError, EventError, SequenceError
from pipeline.core.events import Event, JsonValue
from pipeline.services.replay.topic import (
    Decoder,
    Encoder,
    event_records,
    minimal_header,
    session_header_of,
)
from pipeline.settings import Settings

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What importing one file did."""

    path: str
    session_id: str
    events: int
    already_on_topic: int
    published: int


def session_id_for(path: str | os.PathLike[str], header: dict[str, JsonValue] | None) -> str:
    """The header's id, else the folder name of a ``session.jsonl[.zstd]``, else the stem."""
    value = header.get("id") if header else None
    if isinstance(value, str) and value:
        return value
    file = Path(path)
    if file.name.startswith("session.jsonl"):
        return file.parent.name
    return file.name.split(".")[0]


def new_events(path: str, session_id: str, file_events: Sequence[Event],
               on_topic: Sequence[Event]) -> list[Event]:
    """The file's events the topic does not hold yet; a differing event at a seq refuses."""
    for held in on_topic:
        if held.seq >= len(file_events):
            break  # the topic is ahead of the file: the file is an older copy
        if file_events[held.seq] != held:
            raise EventError(
                f"{path}: session {session_id!r} conflicts with the topic: the topic holds a "
                f"different {held.type!r} event at this seq (the file has "
                f"{file_events[held.seq].type!r}); nothing of this file was published",
                seq=held.seq, rule="import-conflict")
    return list(file_events[len(on_topic):])


class Importer:
    """Imports files through one transactional producer (``async with``)."""

    def __init__(self, settings: Settings, encode: Encoder, decode: Decoder) -> None:
        self.settings = settings
        self.encode = encode
        self.decode = decode
        self.producer = PartitionProducer(
            settings, group_id=f"{settings.group_id_prefix}{settings.topic_prefix}import",
            partition=0)

    async def __aenter__(self) -> Importer:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.close()

    async def import_file(self, path: str | os.PathLike[str], *,
                          session_id: str | None = None) -> ImportResult:
        name = os.fspath(path)
        session_file, _log = load_session(name, mode="ingest")  # refuses an invalid log
        sid = session_id or session_id_for(name, session_file.header)
        held = await topic_events(self.settings, sid, self.decode)
        todo = new_events(name, sid, session_file.events, held)
        topic = self.settings.topics.session_events
        records = event_records(topic, sid, todo, self.encode, session_file.header)
        if records:
            await self.producer.commit(records)
        return ImportResult(name, sid, len(session_file.events), len(held), len(records))


async def topic_events(settings: Settings, session_id: str, decode: Decoder) -> list[Event]:
    """The session's events on the topic, in seq order (a repeated identical seq dropped)."""
    return (await read_session(settings, session_id, decode)).events


@dataclass(slots=True)
class TopicSession:
    """One session read back: the file header seq 0 carried, and the events."""

    header: dict[str, JsonValue] | None = None
    events: list[Event] = field(default_factory=list)

    def lines(self, session_id: str, *, packed: bool = True) -> Iterator[str]:
        """The session as dsh file lines (header first)."""
        return encode_lines(self.events, header=self.header or minimal_header(session_id),
                            packed=packed)


async def read_session(settings: Settings, session_id: str, decode: Decoder) -> TopicSession:
    """One session from the topic; a gap (or a differing repeat) is a SequenceError."""
    found = TopicSession()
    events = found.events
    async for record in session_records(settings, session_id, decode=decode):
        event = record.event
        if event.seq < len(events) and events[event.seq] == event:
            continue  # a duplicate delivery of the same event
        if event.seq != len(events):
            raise SequenceError(expected=len(events), found=event.seq, type=event.type)
        if event.seq == 0:
            found.header = session_header_of(record.headers)
        events.append(event)
    return found


async def export_session(settings: Settings, session_id: str, path: str | os.PathLike[str],
                         decode: Decoder, *, packed: bool = True,
                         spill_dir: str | os.PathLike[str] | None = None) -> int:
    """Write the session to ``path`` (zstd when it ends in .zstd); returns the event count.

    Written to a temporary name and renamed, so a reader never sees half a file. With
    ``spill_dir``, the full text of every spilled tool result is written there too, as
    ``<sha256>.txt`` (the hash its ``tool/result`` names in ``meta.spill``).
    """
    session = await read_session(settings, session_id, decode)
    if not session.events:
        raise ConfigError(f"session {session_id!r} has no events on "
                          f"{settings.topics.session_events!r}")
    write_session_file(path, session.events, packed=packed,
                       header=session.header or minimal_header(session_id))
    if spill_dir is not None:
        await export_spilled(settings, session.events, Path(spill_dir))
    return len(session.events)


async def export_spilled(settings: Settings, events: Sequence[Event], directory: Path
                         ) -> list[Path]:
    """Write each spilled tool result's full text to ``directory/<sha256>.txt``."""
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for ref in spill_refs(events):
        target = directory / f"{ref.sha256}.txt"
        if not target.exists():
            partial = target.with_name(target.name + ".tmp")
            partial.write_bytes((await read_spill(settings, ref)).encode("utf-8"))
            partial.replace(target)
        written.append(target)
    return written
