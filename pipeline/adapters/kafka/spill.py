"""The spill store on Kafka: full texts kept outside the session log, on ``<prefix>spill``.

A spilled text is its UTF-8 bytes cut into chunks of at most :data:`CHUNK_BYTES` (1 MB), one
record each, keyed ``<sha256 of the whole text>:<index>``, all in one partition chosen by
the hash and written in order by one idempotent producer (acks=all) before the caller puts
the reference in the log. The topic is compacted: a text spilled twice (same content, same
keys) is kept once. A reader puts the chunks back together and checks the hash, so a
partially written text (a crash between chunks) is never returned as if it were whole.

:class:`SpillRef` is what the log keeps (``tool/result`` ``meta.spill``): the topic, hash,
size, chunk count, and the partition and offset of the first chunk, so a read seeks straight
to it (and scans the partition if compaction has moved it).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.event_stream import partitions_of
from pipeline.adapters.kafka.options import (
    client_options,
    consumer_size_options,
    producer_size_options,
)
from pipeline.core.errors import BrokerError, CodecError
from pipeline.core.events import JsonValue
from pipeline.settings import Settings

CHUNK_BYTES: Final = 1_000_000
LOCATOR_SCHEME: Final = "kafka:"
SHA_HEADER: Final = "dsh.spill.sha256"
INDEX_HEADER: Final = "dsh.spill.index"
COUNT_HEADER: Final = "dsh.spill.chunks"
TIMEOUT_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class SpillRef:
    """Where one spilled text is: ``topic``, content hash, size, chunks, first chunk."""

    topic: str
    sha256: str
    bytes: int
    chunks: int
    partition: int
    offset: int

    @property
    def locator(self) -> str:
        """The text the model and users are shown: ``kafka:<topic>/sha256:<hex>``."""
        return f"{LOCATOR_SCHEME}{self.topic}/sha256:{self.sha256}"

    def to_meta(self) -> dict[str, JsonValue]:
        return {"locator": self.locator, "topic": self.topic, "sha256": self.sha256,
                "bytes": self.bytes, "chunks": self.chunks, "partition": self.partition,
                "offset": self.offset}

    @classmethod
    def from_meta(cls, meta: JsonValue) -> SpillRef | None:
        """The reference in a ``tool/result``'s ``meta`` (``meta.spill``), or None."""
        spill = meta.get("spill") if isinstance(meta, Mapping) else None
        if not isinstance(spill, Mapping):
            return None
        try:
            return cls(str(spill["topic"]), str(spill["sha256"]), int(spill["bytes"]),
                       int(spill["chunks"]), int(spill["partition"]), int(spill["offset"]))
        except (KeyError, TypeError, ValueError):
            return None


def chunks_of(data: bytes) -> list[bytes]:
    """``data`` in pieces of at most :data:`CHUNK_BYTES` (one empty piece for no data)."""
    return [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]


def partition_of(sha256: str, partitions: int) -> int:
    """The partition that holds every chunk of the text with this hash."""
    return int(sha256[:8], 16) % partitions


async def save_spill(settings: Settings, text: str) -> SpillRef:
    """Write ``text`` to the spill topic and wait until every chunk is acknowledged."""
    data = text.encode("utf-8")
    sha = hashlib.sha256(data).hexdigest()
    topic = settings.topics.spill
    producer = AIOKafkaProducer(**client_options(settings), **producer_size_options(settings),
                                enable_idempotence=True, acks="all")
    try:
        with broker_errors(f"spill {len(data):,} bytes to {topic!r}"):
            await asyncio.wait_for(producer.start(), TIMEOUT_S)
            partitions = await producer.partitions_for(topic)
            if not partitions:
                raise BrokerError(f"topic {topic!r} does not exist: run `dsh-pipeline topics "
                                  "ensure`")
            partition = partition_of(sha, len(partitions))
            pieces = chunks_of(data)
            futures = [await producer.send(
                topic, piece, key=f"{sha}:{index}".encode(), partition=partition,
                headers=[(SHA_HEADER, sha.encode()), (INDEX_HEADER, str(index).encode()),
                         (COUNT_HEADER, str(len(pieces)).encode())])
                for index, piece in enumerate(pieces)]
            metas = await asyncio.wait_for(asyncio.gather(*futures), TIMEOUT_S)
    finally:
        await producer.stop()
    return SpillRef(topic, sha, len(data), len(pieces), partition, metas[0].offset)


async def read_spill(settings: Settings, ref: SpillRef | str) -> str:
    """The full text a spill reference (or a locator, or a bare hash) names.

    Raises :class:`CodecError` when the topic does not hold the whole text (its chunks
    missing, or their hash differs), :class:`BrokerError` when the broker cannot be read.
    """
    sha, topic = _target(settings, ref)
    consumer = AIOKafkaConsumer(enable_auto_commit=False, isolation_level="read_committed",
                                **client_options(settings), **consumer_size_options(settings))
    try:
        with broker_errors(f"read spilled text {sha[:12]} from {topic!r}"):
            await asyncio.wait_for(consumer.start(), TIMEOUT_S)
            partitions = await partitions_of(consumer, topic)
            tp = TopicPartition(topic, partition_of(sha, len(partitions)))
            consumer.assign([tp])
            start = ref.offset if isinstance(ref, SpillRef) else 0
            pieces = await _collect(consumer, tp, sha, start)
            if not _complete(pieces) and start > 0:  # compaction moved them: scan it all
                pieces = await _collect(consumer, tp, sha, 0)
    finally:
        await consumer.stop()
    return _joined(sha, pieces)


def _target(settings: Settings, ref: SpillRef | str) -> tuple[str, str]:
    if isinstance(ref, SpillRef):
        return ref.sha256, ref.topic
    text = ref.removeprefix(LOCATOR_SCHEME)
    topic, _, sha = text.rpartition("/sha256:")
    sha = sha or text
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise CodecError(f"not a spill locator or sha256: {ref[:100]!r}")
    return sha, topic or settings.topics.spill


class _Pieces(dict[int, bytes]):
    count: int = -1


def _complete(pieces: _Pieces) -> bool:
    return pieces.count >= 0 and all(i in pieces for i in range(pieces.count))


async def _collect(consumer: AIOKafkaConsumer, tp: TopicPartition, sha: str, start: int
                   ) -> _Pieces:
    """Chunks of ``sha`` from ``start`` until all are found or the partition ends."""
    consumer.seek(tp, start)
    end = (await consumer.end_offsets([tp]))[tp]
    prefix = f"{sha}:".encode()
    pieces = _Pieces()
    while not _complete(pieces) and await consumer.position(tp) < end:
        batch = await consumer.getmany(tp, timeout_ms=1000, max_records=100)
        for record in batch.get(tp, []):
            if record.key is None or not record.key.startswith(prefix):
                continue
            pieces[int(record.key[len(prefix):])] = record.value or b""
            for name, value in record.headers or ():
                if name == COUNT_HEADER and value:
                    pieces.count = int(value)
    return pieces


def _joined(sha: str, pieces: _Pieces) -> str:
    if not pieces:
        raise CodecError(f"the spill topic holds no chunk of the text with sha256 {sha}")
    data = b"".join(pieces[i] for i in range(len(pieces)) if i in pieces)
    if not _complete(pieces) or hashlib.sha256(data).hexdigest() != sha:
        raise CodecError(f"the spill topic holds an incomplete copy of the text with sha256 "
                         f"{sha} ({len(pieces)} chunk(s), {len(data):,} bytes)")
    return data.decode("utf-8")


def spill_refs(events: Any) -> list[SpillRef]:
    """The spill references of the ``tool/result`` events in ``events``, in log order."""
    found: list[SpillRef] = []
    for event in events:
        if event.type == "tool/result" and isinstance(event.data, Mapping):
            ref = SpillRef.from_meta(event.data.get("meta"))
            if ref is not None:
                found.append(ref)
    return found
