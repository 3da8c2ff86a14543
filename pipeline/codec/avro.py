"""Session events as Avro: the envelope record, the two wire framings, :class:`EventSerde`.

Wire framings (DESIGN.md section 2); one decoder accepts both, dispatching on the first byte:

- Confluent wire format: ``00`` + 4-byte big-endian registry schema id + Avro body;
- Avro single-object encoding: ``C3 01`` + 8-byte little-endian CRC-64-AVRO fingerprint of
  the writer schema's parsing canonical form + Avro body.

Records are read with their *writer* schema and turned back into JSON by the generic codec of
:mod:`pipeline.codec.payload`: the writer schema determines the JSON exactly, so an event
written with any committed version (or a later one this code has never seen) comes back
identical. Reading through today's schema by Avro resolution could only drop what the writer
knew and the reader does not; the registry's BACKWARD_TRANSITIVE rule is what keeps that
resolution possible for other readers (Spark, DuckDB, Java).

The bytes are written and read by the schema-compiled codec of :mod:`pipeline.codec.binary`
(fastavro is the reference it is tested against byte for byte, and writes container files).
The hot paths skip the record dicts in between: :func:`pipeline.codec.envelope.
direct_event_writer` writes an Event's bytes straight from it (the typed payloads by the
generated writers of :mod:`pipeline.codec.payload_writer`) and leaves anything unusual to
the record path (:class:`EventRecords` + the compiled codec), whose bytes it matches exactly;
the compiled decoder builds ``(session id, Event)`` itself (``EventRecordBuilder``).
Every failure is a :class:`CodecError` (or :class:`SchemaError`) naming what was wrong; no
foreign exception leaves this module.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

from pipeline.codec.binary import DECODE_ERRORS, trailing_bytes, undecodable
from pipeline.codec.envelope import (
    DIRECT_DECLINES,
    EventWriter,
    direct_event_writer,
    event_from_record,
)
from pipeline.codec.payload import (
    JSON_PAYLOAD,
    RecordPlan,
    Unrepresentable,
    event_type_plans,
    json_text,
    json_text_ascii,
)
from pipeline.codec.schemas import (
    CONFLUENT_HEADER_LEN,
    SINGLE_OBJECT_HEADER_LEN,
    SchemaTable,
    WriterSchema,
    current_event_schema,
)
from pipeline.core.errors import CodecError
from pipeline.core.events import Event, Replace, SurfaceOp

__all__ = ["EventRecords", "EventSerde", "decode_bodies", "decode_body", "event_from_record"]

Framing = Literal["confluent", "single-object"]


class EventRecords:
    """Event <-> the envelope record of one writer schema (today's, for writing)."""

    def __init__(self, schema: WriterSchema | None = None) -> None:
        self.schema = schema or current_event_schema()
        self._type_plans: dict[str, RecordPlan] = event_type_plans(self.schema.parsed)

    def to_record(self, session_id: str, event: Event, *, ascii_only: bool = False
                  ) -> dict[str, Any]:
        """The envelope record; ``ascii_only`` forces the JSON payload with escaped text
        (the way to carry strings UTF-8 cannot encode, such as lone surrogates)."""
        op = event.surface_op
        sources = event.source_event_seqs
        return {
            "sessionId": session_id, "seq": event.seq, "time": event.time, "type": event.type,
            "surfaceOp": None if op is None else _surface_op_record(op),
            "sourceEventSeqs": None if sources is None else list(sources),
            "ignorable": event.ignorable,
            "payload": self._payload(event, ascii_only),
            "keyOrder": None if event.key_order is None else list(event.key_order),
        }

    def _payload(self, event: Event, ascii_only: bool) -> tuple[str, dict[str, Any]]:
        plan = None if ascii_only else self._type_plans.get(event.type)
        try:
            if plan is not None:
                try:
                    return plan.name, plan.encode(event.data)
                except Unrepresentable:
                    pass  # carried exactly by the generic payload instead
            text = json_text_ascii(event.data) if ascii_only else json_text(event.data)
        except (ValueError, TypeError, RecursionError) as exc:
            raise CodecError(f"seq {event.seq}, type {event.type!r}: data is not lossless "
                             f"JSON ({exc})") from None
        return JSON_PAYLOAD, {"data": text}


def _surface_op_record(op: SurfaceOp) -> Any:
    if isinstance(op, Replace):
        return {"start": op.start, "end": op.end}
    return op


class EventSerde:
    """Synchronous, fast encode/decode of session events for Kafka record values.

    Writes today's schema, Confluent-framed when given the registry id of today's schema
    (register it once up front, e.g. with ``pipeline.adapters.registry``), else as Avro
    single-object encoding. Decodes both framings, with any committed schema version, and
    with registry ids resolved through the table's lookup (once per id). Thread-safe; build
    one per process and share it.
    """

    def __init__(self, table: SchemaTable | None = None, *, schema_id: int | None = None
                 ) -> None:
        self.table = table or SchemaTable()
        self.records = EventRecords()
        self.writer = self.records.schema
        self.prefix = self.table.framing_prefix(self.writer, schema_id)
        self.framing: Framing = "confluent" if schema_id is not None else "single-object"
        self.schema_id = schema_id
        self._by_prefix: dict[bytes, tuple[WriterSchema, int]] = {}
        self._direct = _current_direct_writer()

    def encode(self, session_id: str, event: Event) -> bytes:
        """The framed Avro bytes of one event. Raises CodecError if it cannot be encoded."""
        if self._direct is not None:
            out = bytearray(self.prefix)
            try:
                self._direct(out, session_id, event)
                return bytes(out)
            except DIRECT_DECLINES:
                pass  # the record path decides: another payload shape, or a clear error
        return self._encode_record(session_id, event)

    def _encode_record(self, session_id: str, event: Event) -> bytes:
        out = bytearray(self.prefix)
        try:
            self.writer.binary.encode_into(out, self.records.to_record(session_id, event))
        except UnicodeEncodeError:
            return self._encode_ascii(session_id, event)
        except CodecError as exc:
            raise CodecError(f"seq {event.seq}, type {event.type!r}: cannot encode as Avro: "
                             f"{exc}") from None
        return bytes(out)

    def _encode_ascii(self, session_id: str, event: Event) -> bytes:
        out = bytearray(self.prefix)
        try:
            record = self.records.to_record(session_id, event, ascii_only=True)
            self.writer.binary.encode_into(out, record)
        except (CodecError, UnicodeEncodeError) as exc:
            raise CodecError(f"seq {event.seq}, type {event.type!r}: cannot encode as Avro "
                             f"(the session id or type is not valid Unicode?): {exc}") from None
        return bytes(out)

    def decode(self, data: bytes) -> tuple[str, Event]:
        """(session id, event) from framed bytes of either framing."""
        if type(data) is not bytes:
            data = _as_bytes(data)
        # The framing prefix of a record names its writer schema; most records share one.
        # Keys: the 10 bytes of a single-object prefix, the 5 of a Confluent one.
        known = self._by_prefix.get(data[:SINGLE_OBJECT_HEADER_LEN]) or self._by_prefix.get(
            data[:CONFLUENT_HEADER_LEN]) or self._learn_prefix(data)
        size = len(data)
        try:  # the decoder in use itself, not CompiledSchema.decode: a call less per record
            decoded, end = known[0].binary.decoder(data, known[1], size)
        except DECODE_ERRORS as exc:
            raise undecodable(exc) from None
        if end != size:
            raise trailing_bytes(size - end)
        if type(decoded) is tuple:  # the usual: the decoder built the event itself
            return decoded
        return _from_record(decoded, known[0])

    def _learn_prefix(self, data: bytes) -> tuple[WriterSchema, int]:
        return self.table.remember_writer(_as_bytes(data), "event", self._by_prefix)

    def writer_of(self, data: bytes) -> tuple[WriterSchema, int]:
        """The writer schema of framed bytes and where the Avro body starts."""
        return self.table.writer_of(_as_bytes(data), "event")


@cache
def _current_direct_writer() -> EventWriter | None:
    return direct_event_writer(current_event_schema())


def _as_bytes(data: object) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, bytearray | memoryview):
        return bytes(data)
    raise CodecError(f"expected bytes to decode, got {type(data).__name__}")


def decode_body(data: bytes, start: int, writer: WriterSchema) -> tuple[str, Event]:
    """Decode the Avro body at ``data[start:]``, which must be exactly one record."""
    decoded = writer.binary.decode(data, start)
    if type(decoded) is tuple:  # the usual: the compiled decoder built the event itself
        return decoded
    return _from_record(decoded, writer)


def decode_bodies(data: bytes, count: int, writer: WriterSchema) -> list[tuple[str, Event]]:
    """``count`` Avro bodies written back to back, filling ``data`` exactly (the block of
    an object container file): read by the same decoder as framed records, so a file and
    a topic refuse and accept the same bytes."""
    events = []
    pos = 0
    for _ in range(count):
        decoded, pos = writer.binary.decode_at(data, pos)
        events.append(decoded if type(decoded) is tuple else _from_record(decoded, writer))
    if pos != len(data):
        raise CodecError(f"{len(data) - pos} trailing bytes after the {count} records of the "
                         f"block")
    return events


def _from_record(record: Any, writer: WriterSchema) -> tuple[str, Event]:
    """A writer schema whose envelope the direct path does not know: via the record."""
    try:
        return event_from_record(record, writer, json_payload=True)
    except CodecError as exc:
        raise CodecError(f"decoded record: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise CodecError(f"decoded record does not fit the envelope: {exc}") from None
