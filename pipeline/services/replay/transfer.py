"""Import dsh session files into the session topic, and export a session back to a file.

Import is idempotent: every (session, seq) is published exactly once however often a file
is imported, and a file that disagrees with the topic is refused whole.

1. the importer's transactional producer starts first, which fences any earlier importer
   and aborts its open transaction (one transactional id for all importers of a prefix);
2. which sessions the topic holds is read once, from the record headers (read committed,
   so what a fenced importer left half-done is invisible);
3. files are read in groups of about ``batch_events`` events; the events the topic already
   holds of the group's sessions are read (only when it holds any), and each of them must
   equal the file's event at that seq, or the file is refused
   (:class:`~pipeline.core.errors.EventError`, rule ``import-conflict``) with nothing of it
   sent: the files before it in the group are published, those after it are not;
4. the rest of every file of the group is published in ONE transaction (a crash leaves all
   of the group or none of it), partitioned as the default partitioner would, so the
   producer sends whole batches.

Export reads the session (its partition only) and writes header + events, packed as dsh
writes its files, so export(import(x)) == x byte for byte for a file dsh wrote.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.adapters.kafka.checkpoints import writer_marks
from pipeline.adapters.kafka.event_stream import partition_for, session_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.session_first import first_offset_of
from pipeline.adapters.kafka.spill import read_spill, spill_refs
from pipeline.adapters.kafka.topic_scan import last_seqs
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.codec.sessionfile import (
    encode_lines,
    load_session,
    write_session_file,
)
from pipeline.core.errors import CodecError, ConfigError, DshError, EventError, SequenceError
from pipeline.core.events import Event, JsonValue
from pipeline.services.replay.prepare import (
    EncoderFactory,
    PreparedFile,
    Preparer,
)
from pipeline.services.replay.prepare import session_id_for as session_id_for
from pipeline.services.replay.topic import (
    Decoder,
    Encoder,
    event_records,
    minimal_header,
    read_sessions,
    session_header_of,
)
from pipeline.settings import Settings

Progress = Callable[[str], None]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What importing one file did."""

    path: str
    session_id: str
    events: int
    already_on_topic: int
    published: int


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


@dataclass(slots=True)
class _Group:
    """Files prepared and waiting for one transaction."""

    files: list[PreparedFile] = field(default_factory=list)
    events: int = 0

    def has(self, session_id: str) -> bool:
        return any(f.session_id == session_id for f in self.files)


class Importer:
    """Imports files through one transactional producer (``async with``).

    ``workers`` > 0 reads, checks and encodes files in that many processes
    (:mod:`.prepare`), which needs ``make_encoder``: an importable function that builds the
    same encoder as ``encode`` in a worker.
    """

    def __init__(self, settings: Settings, encode: Encoder, decode: Decoder, *,
                 batch_events: int = 20_000, progress: Progress | None = None,
                 workers: int = 0, make_encoder: EncoderFactory | None = None) -> None:
        self.settings = settings
        self.encode = encode
        self.decode = decode
        self.batch_events = batch_events
        self.progress = progress or (lambda _line: None)
        self.producer = PartitionProducer(
            settings, group_id=f"{settings.group_id_prefix}{settings.topic_prefix}import",
            partition=0)
        self._workers, self._make_encoder = workers, make_encoder
        self._partitions = 0

    async def __aenter__(self) -> Importer:
        await self.producer.start()
        self._partitions = await self.producer.partition_count(
            self.settings.topics.session_events)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.close()

    async def import_file(self, path: str | os.PathLike[str], *,
                          session_id: str | None = None) -> ImportResult:
        """Import one file (see :meth:`import_files`)."""
        results = [r async for r in self.import_files([path], session_id=session_id)]
        return results[0]

    async def import_files(self, paths: Sequence[str | os.PathLike[str]], *,
                           session_id: str | None = None) -> AsyncIterator[ImportResult]:
        """Import ``paths`` in order; yields each file's result once it is committed.

        A group ends at ``batch_events`` events, and before a second file of a session
        already in it (that file is compared with what the first one published).
        """
        # What the topic holds is read while the first files are prepared.
        holding = asyncio.ensure_future(last_seqs(self.settings,
                                                  self.settings.topics.session_events))
        preparer = Preparer(topic=self.settings.topics.session_events,
                            partitions=self._partitions, encode=self.encode,
                            workers=self._workers, make_encoder=self._make_encoder)
        counts = _Counts(len(paths))
        group = _Group()
        try:
            async for prepared in preparer.prepared(paths, session_id):
                if group.has(prepared.session_id):
                    async for result in self._publish(group, await holding, counts):
                        yield result
                    group = _Group()
                group.files.append(prepared)
                group.events += prepared.events
                if group.events >= self.batch_events:
                    async for result in self._publish(group, await holding, counts):
                        yield result
                    group = _Group()
            async for result in self._publish(group, await holding, counts):
                yield result
        finally:
            holding.cancel()

    async def _publish(self, group: _Group, last: dict[str, int], counts: _Counts
                       ) -> AsyncIterator[ImportResult]:
        """One transaction for the group's new events; a refused file stops the import
        there (the files before it are published)."""
        held = await self._held(group, last)
        records: list[OutRecord] = []
        results: list[ImportResult] = []
        refused: DshError | None = None
        for prepared in group.files:
            try:
                found = self._new_records(prepared, held)
            except DshError as exc:
                refused = exc
                break
            records += found[0]
            results.append(found[1])
        if records:
            await self.producer.commit(
                [*records, *writer_marks(records, self.settings.topics.driver_checkpoints)])
        for result in results:
            if result.events:
                last[result.session_id] = max(last.get(result.session_id, -1),
                                              result.events - 1)
            counts.add(result)
            yield result
        if results:
            self.progress(counts.line())
        if refused is not None:
            raise refused

    def _new_records(self, prepared: PreparedFile, held: dict[str, list[Event]]
                     ) -> tuple[list[OutRecord], ImportResult]:
        """The file's records the topic lacks: all of them for a session it does not hold,
        else those after what it holds, once that is found equal to the file."""
        sid, name = prepared.session_id, prepared.path
        if prepared.rows is not None and sid not in held:
            records = prepared.records(self.settings.topics.session_events)
            return records, ImportResult(name, sid, prepared.events, 0, prepared.events)
        session_file, _log = load_session(name, mode="ingest")  # raises what was wrong
        on_topic = held.get(sid, [])
        todo = new_events(name, sid, session_file.events, on_topic)
        records = event_records(self.settings.topics.session_events, sid, todo, self.encode,
                                session_file.header,
                                partition=partition_for(sid, self._partitions))
        return records, ImportResult(name, sid, len(session_file.events), len(on_topic),
                                     len(todo))

    async def _held(self, group: _Group, last: dict[str, int]) -> dict[str, list[Event]]:
        """The events the topic holds of the group's sessions (read only if it holds any)."""
        present = {f.session_id for f in group.files if f.session_id in last}
        if not present:
            return {}
        found = await read_sessions(self.settings, self.decode, only=present)
        if found.undecodable:
            raise CodecError(f"the session topic holds undecodable records of sessions "
                             f"being imported: {found.undecodable[0]}")
        held = {sid: _in_seq_order(e.event for e in logged)
                for sid, logged in found.events.items()}
        return {sid: held.get(sid, []) for sid in present}


@dataclass(slots=True)
class _Counts:
    """Progress of one import: files done and events published, since it started."""

    files: int
    done: int = 0
    published: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, result: ImportResult) -> None:
        self.done += 1
        self.published += result.published

    def line(self) -> str:
        rate = self.published / max(time.monotonic() - self.started, 1e-6)
        return (f"imported {self.done}/{self.files} files, {self.published:,} events "
                f"published ({rate:,.0f}/s)")


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


async def read_session(settings: Settings, session_id: str, decode: Decoder, *,
                       read: Callable[[int, int], None] | None = None) -> TopicSession:
    """One session from the topic, from where its fleet record says its first event lies;
    a gap (or a differing repeat) is a SequenceError. ``read(partition, offset)`` is told
    each record fetched."""
    found = TopicSession()
    start = await first_offset_of(settings, session_id)   # None: from the partition's start
    records = [r async for r in session_records(settings, session_id, decode=decode,
                                                from_offset=start or 0, read=read)]
    if start and (not records or records[0].event.seq != 0):   # not where it said: all of it
        log.warning("session %s: its first event is not at offset %d as its fleet record "
                    "says; reading its partition from the start", session_id, start)
        records = [r async for r in session_records(settings, session_id, decode=decode,
                                                    read=read)]
    found.events = _in_seq_order(r.event for r in records)
    first = next((r for r in records if r.event.seq == 0), None)
    if first is not None:
        found.header = session_header_of(first.headers)
    return found


def _in_seq_order(logged: Iterable[Event]) -> list[Event]:
    """A session's events as the topic holds them: a repeated identical seq dropped, a gap
    or a differing repeat a :class:`SequenceError`."""
    events: list[Event] = []
    for event in logged:
        if event.seq < len(events) and events[event.seq] == event:
            continue  # a duplicate delivery of the same event
        if event.seq != len(events):
            raise SequenceError(expected=len(events), found=event.seq, type=event.type)
        events.append(event)
    return events


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
