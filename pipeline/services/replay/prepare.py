"""Session files read, checked and encoded for import, in worker processes.

Reading a dsh file, folding it (the ingest checks) and encoding every event is the CPU work
of an import; sending is little. With ``workers`` > 0 that work runs in a pool of processes,
several files at once and ahead of the importer, which meanwhile sends and commits; the
results come back in the order of the files. With 0 it runs in the importer's process.

A worker returns the records of every event of the file: the importer uses them as they
are for a session the topic does not hold yet, and reads the file again itself (to compare
event by event) for one it holds. A file a worker cannot read comes back without records;
the importer reads it again to raise the error itself.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass

from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.adapters.kafka.records import Headers, OutRecord
from pipeline.codec.avro import EventSerde
from pipeline.codec.records import record_key
from pipeline.codec.sessionfile import load_session
from pipeline.core.errors import DshError
from pipeline.core.events import JsonValue
from pipeline.services.replay.topic import Encoder, event_records

EncoderFactory = Callable[[], Encoder]
# Files read ahead per worker: enough that the workers prepare the next group while the
# importer sends and commits one.
AHEAD_PER_WORKER = 16
PARENT_CHECK_S = 1.0

_worker_encode: Encoder | None = None


def session_id_for(path: str | os.PathLike[str], header: dict[str, JsonValue] | None) -> str:
    """The header's id, else the folder name of a ``session.jsonl[.zstd]``, else the stem."""
    value = header.get("id") if header else None
    if isinstance(value, str) and value:
        return value
    name = os.path.basename(os.fspath(path))
    if name.startswith("session.jsonl"):
        return os.path.basename(os.path.dirname(os.path.abspath(path)))
    return name.split(".")[0]


@dataclass(frozen=True, slots=True)
class PreparedFile:
    """One file read and encoded: its session, event count, and each event's record value
    and headers (``rows`` None: unreadable). Plain tuples: they cross from a worker process
    several times cheaper than record objects."""

    path: str
    session_id: str
    events: int
    partition: int
    rows: tuple[tuple[bytes, Headers], ...] | None

    def records(self, topic: str) -> list[OutRecord]:
        """The file's records for ``topic`` (none for an unreadable file)."""
        key = record_key(self.session_id)
        return [OutRecord(topic, key, value, headers, self.partition)
                for value, headers in self.rows or ()]


def prepare_file(path: str, session_id: str | None, topic: str, partitions: int,
                 encode: Encoder | None = None) -> PreparedFile:
    """Read and check ``path`` and encode its events (``encode`` None: the worker's)."""
    encoder = encode or _worker_encode
    if encoder is None:
        raise RuntimeError("prepare_file needs an encoder outside a worker process")
    try:
        session_file, _log = load_session(path, mode="ingest")
    except DshError:
        return PreparedFile(path, session_id or "", 0, 0, None)
    sid = session_id or session_id_for(path, session_file.header)
    records = event_records(topic, sid, session_file.events, encoder, session_file.header)
    return PreparedFile(path, sid, len(session_file.events), partition_for(sid, partitions),
                        # an event's record always has a value (never a tombstone)
                        tuple((r.value or b"", r.headers) for r in records))


def avro_encoder() -> Encoder:
    """The encoder of the session topic without a registry (single-object encoding): the
    ``make_encoder`` of ``dsh-pipeline import``."""
    return EventSerde().encode


def default_workers() -> int:
    """Worker processes for an import: one per core, at most 4 (sending needs one too)."""
    return min(4, os.cpu_count() or 1)


def _start_worker(make_encoder: EncoderFactory, parent: int) -> None:
    global _worker_encode
    _worker_encode = make_encoder()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    """Ends this worker once the importer is gone: a killed importer (SIGKILL) cannot stop
    its pool, and its workers would otherwise wait for work forever."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


class Preparer:
    """Prepares files in order, in ``workers`` processes (0: here, one after the other)."""

    def __init__(self, *, topic: str, partitions: int, encode: Encoder, workers: int = 0,
                 make_encoder: EncoderFactory | None = None) -> None:
        if workers > 0 and make_encoder is None:
            raise ValueError("worker processes need make_encoder (an importable factory)")
        self.topic = topic
        self.partitions = partitions
        self.encode = encode
        self.workers = workers
        self.make_encoder = make_encoder

    async def prepared(self, paths: Sequence[str | os.PathLike[str]],
                       session_id: str | None) -> AsyncIterator[PreparedFile]:
        """Each file of ``paths`` prepared, in order."""
        if self.workers <= 0:
            for path in paths:
                yield prepare_file(os.fspath(path), session_id, self.topic, self.partitions,
                                   self.encode)
                await asyncio.sleep(0)  # let the producer's sends make progress
            return
        with self._pool() as pool:
            async for prepared in self._in_pool(pool, paths, session_id):
                yield prepared

    def _pool(self) -> ProcessPoolExecutor:
        # fork: the workers start at once (no re-import of the pipeline); they only run
        # prepare_file, never the parent's event loop or clients.
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        assert self.make_encoder is not None
        return ProcessPoolExecutor(self.workers, mp_context=context,
                                   initializer=functools.partial(_start_worker,
                                                                 self.make_encoder,
                                                                 os.getpid()))

    async def _in_pool(self, pool: Executor, paths: Sequence[str | os.PathLike[str]],
                       session_id: str | None) -> AsyncIterator[PreparedFile]:
        loop = asyncio.get_running_loop()
        queue = iter(paths)
        running: deque[asyncio.Future[PreparedFile]] = deque()

        def submit() -> None:
            path = next(queue, None)
            if path is not None:
                running.append(loop.run_in_executor(pool, prepare_file, os.fspath(path),
                                                    session_id, self.topic, self.partitions))

        try:
            for _ in range(self.workers * AHEAD_PER_WORKER):
                submit()
            while running:
                prepared = await running.popleft()
                submit()
                yield prepared
        finally:
            for future in running:
                future.cancel()
