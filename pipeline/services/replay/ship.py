"""The shipper: follows a directory tree of dsh session files and publishes each event once.

The topic is the checkpoint. On start the shipper's transactional producer fences any earlier
shipper of the same directory (aborting its open transaction), then the highest seq of every
session on the topic is read from the record headers (read committed, once every transaction
open on the topic has ended: :mod:`pipeline.adapters.kafka.settled_ends`): the next event to
publish for a session is that seq + 1. Each pass re-reads the files whose size or mtime
changed (``session.jsonl`` or ``session.jsonl.zstd``, packed rows expanded, a torn last line
or zstd frame left for a later pass) and publishes the new events of many files together, in
transactions of at most ``batch`` events. A crash between two transactions loses nothing and a
restart duplicates nothing: what was committed is on the topic, what was not is published
again.

A file whose first event seq is past the topic's next seq, or with a bad line, is reported and
its events from there on are held back (publishing past a hole would make a gap).

Following, a pass that fails on the broker (a node restarting, a connection cut: the producer
of a failed transaction is not used again) starts over as a restart would: a new producer
fences the old one (aborting its open transaction), the checkpoint is read again from the
topic, and every file is read again; the delay doubles from 1 s to 30 s while it keeps
failing. A refusal (an ACL) or being fenced by another shipper of the directory stops it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.adapters.kafka.checkpoints import writer_marks
from pipeline.adapters.kafka.errors import is_fencing, is_refusal
from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.topic_scan import last_seqs
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.codec.sessionfile import FileProblem, SessionFile, scan_session_file
from pipeline.core.errors import BrokerError, SessionFileError
from pipeline.core.events import Event, JsonValue
from pipeline.services.replay.prepare import session_id_for
from pipeline.services.replay.topic import Encoder, event_records
from pipeline.settings import Settings

Progress = Callable[[str], None]
NewEvents = tuple[str, list[Event], dict[str, JsonValue] | None]
SUFFIXES = (".jsonl", ".jsonl.zstd")
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0


def session_files(root: Path) -> Iterator[Path]:
    """Every dsh session file under ``root`` (sorted, so passes are reproducible)."""
    for path in sorted(root.rglob("*")):
        if path.name.endswith(SUFFIXES) and ".tmp" not in path.name and path.is_file():
            yield path


@dataclass(slots=True)
class ShipStats:
    files: int = 0
    sessions: int = 0
    published: int = 0
    transactions: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Seen:
    size: int
    mtime_ns: int


@dataclass(slots=True)
class _Pending:
    """Records waiting for the next transaction, and what they advance once committed."""

    records: list[OutRecord] = field(default_factory=list)
    next_seq: dict[str, int] = field(default_factory=dict)
    seen: list[tuple[Path, _Seen]] = field(default_factory=list)
    events: int = 0


class Shipper:
    """Publishes new events of the files under ``root``; use ``async with`` then :meth:`run`."""

    def __init__(self, settings: Settings, root: str | os.PathLike[str], encode: Encoder, *,
                 batch: int = 5000, progress: Progress | None = None,
                 live: Progress | None = None, request_timeout_s: float = 30.0) -> None:
        """``progress`` gets a summary line per pass and every problem; ``live`` a line
        after every transaction (the CLI shows those only on a terminal);
        ``request_timeout_s`` bounds each of the producer's requests (a pass on a dead
        broker fails after it, and the abort after that)."""
        self.settings = settings
        self.root = Path(root).resolve()
        self.encode = encode
        self.batch = batch
        self.progress = progress or (lambda _line: None)
        self.live = live or (lambda _line: None)
        self.request_timeout_s = request_timeout_s
        self.stats = ShipStats()
        self.next_seq: dict[str, int] = {}
        self._seen: dict[Path, _Seen] = {}
        self._reported: set[str] = set()
        self._partitions = 0
        self._ready = False   # started, checkpoint read; False after a broker failure
        digest = hashlib.sha256(str(self.root).encode()).hexdigest()[:12]
        self._group_id = f"{settings.group_id_prefix}{settings.topic_prefix}ship-{digest}"
        self.producer = self._new_producer()

    def _new_producer(self) -> PartitionProducer:
        return PartitionProducer(self.settings, group_id=self._group_id, partition=0,
                                 request_timeout_s=self.request_timeout_s)

    async def __aenter__(self) -> Shipper:
        if not self.root.is_dir():
            raise SessionFileError(f"{self.root}: not a directory", path=str(self.root))
        await self._start()
        return self

    async def _start(self) -> None:
        """Fence an earlier shipper (or this one's failed producer), then read the
        checkpoint; every file is read again at the next pass."""
        await self.producer.start()  # fences an earlier shipper before reading the checkpoint
        try:
            self._partitions = await self.producer.partition_count(
                self.settings.topics.session_events)
            found = await last_seqs(self.settings, self.settings.topics.session_events)
        except BaseException:
            await self.producer.close()
            raise
        self.next_seq = {sid: seq + 1 for sid, seq in found.items()}
        self._seen.clear()
        self._ready = True

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.close()

    async def run(self, *, follow: bool = False, interval_s: float = 1.0) -> ShipStats:
        """One pass over the tree, or (``follow``) passes every ``interval_s`` until cancelled
        (a broker failure then starts over, see the module doc)."""
        delay_s = RETRY_FIRST_S
        while True:
            started, before = time.monotonic(), self.stats.published
            try:
                if not self._ready:
                    await self._start_over()
                await self.pass_once()
            except BrokerError as exc:
                if not follow or is_refusal(exc) or is_fencing(exc):
                    raise
                self._ready = False
                self.progress(f"{exc}; starting over from the topic in {delay_s:.0f} s")
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, RETRY_MAX_S)
                continue
            delay_s = RETRY_FIRST_S
            shipped = self.stats.published - before
            if shipped or not follow:
                rate = shipped / max(time.monotonic() - started, 1e-6)
                self.progress(f"shipped {shipped} events ({rate:,.0f}/s); total "
                              f"{self.stats.published} events, {len(self.next_seq)} sessions, "
                              f"{self.stats.files} files")
            if not follow:
                return self.stats
            await asyncio.sleep(interval_s)

    async def _start_over(self) -> None:
        """A new producer (the failed one is not used again) and checkpoint."""
        await self.producer.close()
        self.producer = self._new_producer()
        await self._start()
        self.progress(f"started over: the topic holds {len(self.next_seq)} sessions "
                      f"({sum(self.next_seq.values()):,} events)")

    async def pass_once(self) -> int:
        """Publish what is new in every changed file; returns the number of events shipped.

        The new events of many files go into one transaction (up to ``batch`` events; a
        file with more is split in seq order), so a pass over many small files costs few
        transactions. A file counts as seen once its events are committed.
        """
        shipped = 0
        files = 0
        pending = _Pending()
        for path in session_files(self.root):
            files += 1
            stat = path.stat()
            seen = _Seen(stat.st_size, stat.st_mtime_ns)
            if self._seen.get(path) == seen:
                continue
            queued = ChainMap(pending.next_seq, self.next_seq)  # this transaction's first
            for sid, part, header in self._new_events(path, queued):
                pending.records += event_records(
                    self.settings.topics.session_events, sid, part, self.encode, header,
                    partition=partition_for(sid, self._partitions))
                pending.next_seq[sid] = part[-1].seq + 1
                pending.events += len(part)
                if pending.events >= self.batch:
                    shipped += await self._commit(pending)
                    pending = _Pending()
            pending.seen.append((path, seen))
        shipped += await self._commit(pending)
        self.stats.files = files
        self.stats.sessions = len(self.next_seq)
        return shipped

    def _new_events(self, path: Path, next_seq: Mapping[str, int]) -> Iterator[NewEvents]:
        """The file's events after ``next_seq`` of its session, in pieces of at most
        ``batch``."""
        try:
            session_file, problems = scan_session_file(path)
        except SessionFileError as exc:
            self._report(str(exc))
            return
        events = _contiguous_prefix(session_file, problems, self._report)
        if not events:
            return
        sid = session_id_for(path, session_file.header)
        start = next_seq.get(sid, 0)
        if events[0].seq > start:
            self._report(f"{path}: session {sid!r} starts at seq {events[0].seq} but the topic "
                         f"expects {start}; held back")
            return
        todo = events[start - events[0].seq:]
        for offset in range(0, len(todo), self.batch):
            yield sid, todo[offset:offset + self.batch], session_file.header

    async def _commit(self, pending: _Pending) -> int:
        """One transaction for the pending events; then their sessions and files advance."""
        if pending.records:
            marks = writer_marks(pending.records, self.settings.topics.driver_checkpoints)
            await self.producer.commit([*pending.records, *marks])
            self.stats.transactions += 1
        self.next_seq.update(pending.next_seq)
        self.stats.published += pending.events
        self._seen.update(pending.seen)
        if pending.events:
            self.live(f"shipped {self.stats.published:,} events, {len(self._seen)} files")
        return pending.events

    def _report(self, problem: str) -> None:
        if problem not in self._reported:  # a file re-read every pass reports once
            self._reported.add(problem)
            self.stats.problems.append(problem)
            self.progress(f"problem: {problem}")


def _contiguous_prefix(session_file: SessionFile, problems: Sequence[FileProblem],
                       report: Callable[[str], None]) -> list[Event]:
    """The events before the first problem line (all of them when the file is clean)."""
    events = list(session_file.events)
    if not problems:
        return events
    first = problems[0]
    report(str(first))
    line = first.line
    if line is None:
        return []
    return [e for e, at in zip(events, session_file.lines, strict=True) if at < line]
