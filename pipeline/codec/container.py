"""Session events in an Avro object container file (``.avro``), for tools outside Kafka.

The file is a standard Avro object container (written by fastavro, deflate codec) whose
schema is today's ``dsh.SessionEvent``: Spark, DuckDB, Java's avro-tools read it as is.
The session header line of the dsh file travels in the file metadata (``dsh.header``, its
compact JSON), so decoding gives back the header and then the same events.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Final

import fastavro

from pipeline.codec.avro import EventRecords, decode_bodies
from pipeline.codec.binary import AvroBinaryError
from pipeline.codec.schemas import WriterSchema
from pipeline.core.errors import CodecError, SchemaError
from pipeline.core.events import Event, JsonValue, dumps_json

HEADER_META: Final = "dsh.header"
CODEC: Final = "deflate"


def write_container(handle: IO[bytes], events: Iterable[Event], *, session_id: str,
                    header: dict[str, JsonValue] | None = None) -> int:
    """Write the events (and the header, if any) to ``handle``; the number of events."""
    records = EventRecords()
    count = 0

    def avro_records() -> Iterator[dict[str, Any]]:
        nonlocal count
        scratch = bytearray()
        for event in events:
            record = records.to_record(session_id, event)
            try:  # what fastavro would choke on mid-block: strings UTF-8 cannot encode
                records.schema.binary.encode_into(scratch, record)
            except UnicodeEncodeError:
                record = records.to_record(session_id, event, ascii_only=True)
            except AvroBinaryError as exc:
                raise CodecError(f"seq {event.seq}, type {event.type!r}: {exc}") from None
            scratch.clear()
            count += 1
            yield record

    metadata = {HEADER_META: dumps_json(header)} if header is not None else {}
    try:
        fastavro.writer(handle, records.schema.parsed, avro_records(), codec=CODEC,
                        metadata=metadata)
    except (ValueError, TypeError, OverflowError) as exc:
        raise CodecError(f"cannot write the Avro container: {exc}") from None
    return count


@dataclass(frozen=True, slots=True)
class ContainerFile:
    """What an Avro container holds: the header (None if none) and the events."""

    header: dict[str, JsonValue] | None
    events: tuple[tuple[str, Event], ...]


def read_container(handle: IO[bytes], name: str = "<avro>") -> ContainerFile:
    """Read a container written by :func:`write_container` (any schema version).

    fastavro reads the file's structure (header, blocks, codec, sync markers); the records
    of each block are read by the decoder of the session topic (:func:`decode_bodies`), so
    a file holds its events to the same rules: fastavro's own reader would, for one, wrap a
    varint beyond 64 bits into some other long without a word."""
    try:
        blocks = fastavro.block_reader(handle)
        schema = blocks.writer_schema
        if not isinstance(schema, dict):
            raise SchemaError("the container's schema is not a record")
        writer = WriterSchema.from_json(schema)
        metadata = dict(blocks.metadata)
        events = tuple(event for block in blocks
                       for event in decode_bodies(_block_bytes(block), block.num_records,
                                                  writer))
    except (CodecError, SchemaError) as exc:
        raise CodecError(f"{name}: {exc}") from None
    except Exception as exc:  # fastavro raises many types on a damaged file
        raise CodecError(f"{name}: not a readable Avro container: {type(exc).__name__}: "
                         f"{exc}"[:300]) from None
    return ContainerFile(_header(metadata, name), events)


def _block_bytes(block: Any) -> bytes:
    """The block's records as written, decompressed (``Block.bytes_``, a BytesIO)."""
    raw = block.bytes_
    return raw.getvalue() if isinstance(raw, io.BytesIO) else bytes(raw)


def _header(metadata: dict[str, Any], name: str) -> dict[str, JsonValue] | None:
    raw = metadata.get(HEADER_META)
    if raw is None:
        return None
    try:
        header = json.loads(raw)
    except ValueError:
        raise CodecError(f"{name}: metadata {HEADER_META} is not JSON") from None
    if not isinstance(header, dict):
        raise CodecError(f"{name}: metadata {HEADER_META} is not a JSON object")
    return header
