"""The shipper: follows a directory tree of dsh session files and publishes each event once.

The topic is the checkpoint. On start the shipper's transactional producer fences any earlier
shipper of the same directory (aborting its open transaction), then the highest seq of every
session on the topic is read from the record headers (read committed): the next event to
publish for a session is that seq + 1. Each pass re-reads the files whose size or mtime
changed (``session.jsonl`` or ``session.jsonl.zstd``, packed rows expanded, a torn last line
or zstd frame left for a later pass) and publishes the new events in transactions of at most
``batch`` events. A crash between two transactions loses nothing and a restart duplicates
nothing: what was committed is on the topic, what was not is published again.

A file whose first event seq is past the topic's next seq, or with a bad line, is reported and
its events from there on are held back (publishing past a hole would make a gap).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.adapters.kafka.topic_scan import last_seqs
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.codec.sessionfile import FileProblem, SessionFile, scan_session_file
from pipeline.core.errors import SessionFileError
from pipeline.core.events import Event
from pipeline.services.replay.topic import Encoder, event_records
from pipeline.services.replay.transfer import session_id_for
from pipeline.settings import Settings

Progress = Callable[[str], None]
SUFFIXES = (".jsonl", ".jsonl.zstd")


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


class Shipper:
    """Publishes new events of the files under ``root``; use ``async with`` then :meth:`run`."""

    def __init__(self, settings: Settings, root: str | os.PathLike[str], encode: Encoder, *,
                 batch: int = 5000, progress: Progress | None = None) -> None:
        self.settings = settings
        self.root = Path(root).resolve()
        self.encode = encode
        self.batch = batch
        self.progress = progress or (lambda _line: None)
        self.stats = ShipStats()
        self.next_seq: dict[str, int] = {}
        self._seen: dict[Path, _Seen] = {}
        self._reported: set[str] = set()
        digest = hashlib.sha256(str(self.root).encode()).hexdigest()[:12]
        self.producer = PartitionProducer(
            settings, group_id=f"{settings.group_id_prefix}{settings.topic_prefix}ship-{digest}",
            partition=0)

    async def __aenter__(self) -> Shipper:
        if not self.root.is_dir():
            raise SessionFileError(f"{self.root}: not a directory", path=str(self.root))
        await self.producer.start()  # fences an earlier shipper before reading the checkpoint
        found = await last_seqs(self.settings, self.settings.topics.session_events)
        self.next_seq = {sid: seq + 1 for sid, seq in found.items()}
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.close()

    async def run(self, *, follow: bool = False, interval_s: float = 1.0) -> ShipStats:
        """One pass over the tree, or (``follow``) passes every ``interval_s`` until cancelled."""
        while True:
            started, before = time.monotonic(), self.stats.published
            await self.pass_once()
            shipped = self.stats.published - before
            if shipped or not follow:
                rate = shipped / max(time.monotonic() - started, 1e-6)
                self.progress(f"shipped {shipped} events ({rate:,.0f}/s); total "
                              f"{self.stats.published} events, {len(self.next_seq)} sessions, "
                              f"{self.stats.files} files")
            if not follow:
                return self.stats
            await asyncio.sleep(interval_s)

    async def pass_once(self) -> int:
        """Publish what is new in every changed file; returns the number of events shipped."""
        shipped = 0
        files = 0
        for path in session_files(self.root):
            files += 1
            stat = path.stat()
            seen = _Seen(stat.st_size, stat.st_mtime_ns)
            if self._seen.get(path) == seen:
                continue
            shipped += await self._ship_file(path)
            self._seen[path] = seen
        self.stats.files = files
        self.stats.sessions = len(self.next_seq)
        return shipped

    async def _ship_file(self, path: Path) -> int:
        try:
            session_file, problems = scan_session_file(path)
        except SessionFileError as exc:
            self._report(str(exc))
            return 0
        events = _contiguous_prefix(session_file, problems, self._report)
        if not events:
            return 0
        sid = session_id_for(path, session_file.header)
        start = self.next_seq.get(sid, 0)
        if events[0].seq > start:
            self._report(f"{path}: session {sid!r} starts at seq {events[0].seq} but the topic "
                         f"expects {start}; held back")
            return 0
        todo = events[start - events[0].seq:]
        for offset in range(0, len(todo), self.batch):
            part = todo[offset:offset + self.batch]
            records = event_records(self.settings.topics.session_events, sid, part,
                                    self.encode, session_file.header)
            await self.producer.commit(records)
            self.next_seq[sid] = part[-1].seq + 1
            self.stats.published += len(part)
            self.stats.transactions += 1
        return len(todo)

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
