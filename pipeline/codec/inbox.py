"""Avro encoding of inbox commands (``schemas/dsh.InboxCommand.avsc``).

The record mirrors :func:`pipeline.core.inbox.command_to_json`: a ``kind`` string plus the
optional fields of that kind; content blocks and the source travel as compact JSON text so
that unknown block kinds are carried without loss.

Wire framings (DESIGN.md section 2), both accepted by :meth:`InboxCodec.decode`:

- Avro single-object encoding: ``C3 01`` + 8-byte little-endian CRC-64-AVRO fingerprint of
  the writer schema's parsing canonical form + body. Writer schemas are looked up among
  every version in ``schemas/history/`` (by fingerprint).
- Confluent wire format: ``00`` + 4-byte big-endian schema id + body, when the codec was
  given the registry id of today's schema (``confluent_id``); other ids are resolved through
  ``writer_schemas_by_id``.

Every failure is a :class:`CodecError` naming what was wrong; fastavro's exceptions never
leave this module.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from pipeline.codec.binary import CompiledSchema
from pipeline.codec.schema_files import schema_dir
from pipeline.codec.schemas import CONFLUENT_MAGIC, SINGLE_OBJECT_MAGIC
from pipeline.core.errors import CodecError, EventError, SchemaError
from pipeline.core.events import JsonValue, dumps_json
from pipeline.core.inbox import InboxCommand, command_from_json, command_to_json

SCHEMA_DIR: Final = schema_dir()
SCHEMA_FILE: Final = "dsh.InboxCommand.avsc"
HISTORY_GLOB: Final = "dsh.InboxCommand.v*.avsc"
_JSON_FIELDS: Final = ("content", "source")
_OPTIONAL_FIELDS: Final = ("content", "source", "keepQueue", "provider", "model", "system",
                           "tools", "reasoningEffort", "maxTokens", "requireApproval",
                           "approvalPolicy", "callId", "reason", "tenant")


def load_inbox_schema(path: Path | None = None) -> dict[str, Any]:
    """Today's inbox-command schema as a JSON object."""
    with open(path or SCHEMA_DIR / SCHEMA_FILE, encoding="utf-8") as handle:
        schema: dict[str, Any] = json.load(handle)
    return schema


def schema_fingerprint(schema: Mapping[str, Any]) -> bytes:
    """The 8 CRC-64-AVRO bytes of the parsing canonical form (single-object encoding)."""
    canonical = to_parsing_canonical_form(fastavro.parse_schema(dict(schema)))
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


class InboxCodec:
    """Encode/decode :data:`InboxCommand` values; thread-safe for reads, cheap to share."""

    def __init__(self, *, confluent_id: int | None = None,
                 writer_schemas_by_id: Mapping[int, Mapping[str, Any]] | None = None,
                 lookup: Callable[[int], str] | None = None,
                 schema_dir: Path = SCHEMA_DIR) -> None:
        """``lookup`` (e.g. a registry client's ``get_schema``) gives the schema text of a
        registry id not known yet; it is called once per id."""
        self._lookup = lookup
        self.schema_json = load_inbox_schema(schema_dir / SCHEMA_FILE)
        self._schema = fastavro.parse_schema(self.schema_json)
        self._fingerprint = schema_fingerprint(self.schema_json)
        self.confluent_id = confluent_id
        self._by_fingerprint: dict[bytes, Any] = {self._fingerprint: self._schema}
        for path in sorted(schema_dir.glob(f"history/{HISTORY_GLOB}")):
            old = load_inbox_schema(path)
            # setdefault: today's schema is also in the history, and stays the object
            # decode() recognizes as needing no resolution.
            self._by_fingerprint.setdefault(schema_fingerprint(old), fastavro.parse_schema(old))
        self._by_id: dict[int, Any] = {
            int(i): fastavro.parse_schema(dict(s)) for i, s in (writer_schemas_by_id or {}).items()
        }
        if confluent_id is not None:
            self._by_id[confluent_id] = self._schema
        # By id() of the parsed writer schemas above, which this codec keeps alive.
        self._decoders: dict[int, CompiledSchema] = {}

    def encode(self, command: InboxCommand) -> bytes:
        """Confluent framing when a registry id is known, else single-object encoding."""
        record = _to_record(command)
        buffer = io.BytesIO()
        if self.confluent_id is not None:
            buffer.write(struct.pack(">bI", CONFLUENT_MAGIC, self.confluent_id))
        else:
            buffer.write(SINGLE_OBJECT_MAGIC + self._fingerprint)
        fastavro.schemaless_writer(buffer, self._schema, record)
        return buffer.getvalue()

    def decode(self, data: bytes) -> InboxCommand:
        """The command in ``data`` (either framing); :class:`CodecError` when it is not one."""
        if not isinstance(data, bytes | bytearray | memoryview) or len(data) < 5:
            raise CodecError(f"an inbox record must be Avro bytes of at least 5 bytes, got "
                             f"{len(data) if isinstance(data, bytes | bytearray) else data!r}")
        writer, body = self._writer_and_body(bytes(data))
        compiled = self._compiled(writer)
        try:  # fastavro would wrap a varint beyond 64 bits into another long, silently
            record = compiled.decode(body)
        except CodecError as exc:
            raise CodecError(f"inbox record body does not decode as dsh.InboxCommand: "
                             f"{exc}") from None
        if writer is self._schema:
            return _from_record(record)
        try:  # another writer schema: resolved to today's by fastavro, the reference
            record = fastavro.schemaless_reader(io.BytesIO(body), writer, self._schema)
            if not isinstance(record, dict):
                raise TypeError(f"decoded a {type(record).__name__}, not a record")
        except Exception as exc:  # fastavro raises many types; translate them all here
            raise CodecError(f"inbox record body does not decode as "
                             f"dsh.InboxCommand: {type(exc).__name__}: {exc}") from None
        return _from_record(record)

    def _compiled(self, writer: Any) -> CompiledSchema:
        """The compiled decoder of a parsed writer schema (built once per schema)."""
        compiled = self._decoders.get(id(writer))
        if compiled is None:
            try:
                compiled = CompiledSchema(writer)
            except CodecError as exc:
                raise SchemaError(f"inbox writer schema cannot be decoded: {exc}") from None
            self._decoders[id(writer)] = compiled
        return compiled

    def _writer_and_body(self, data: bytes) -> tuple[Any, bytes]:
        if data[:2] == SINGLE_OBJECT_MAGIC:
            if len(data) < 10:
                raise CodecError("single-object encoded inbox record is shorter than its header")
            writer = self._by_fingerprint.get(data[2:10])
            if writer is None:
                raise SchemaError(f"unknown writer schema fingerprint {data[2:10].hex()} for "
                                  f"an inbox record (not in schemas/history/)")
            return writer, data[10:]
        if data[0] == CONFLUENT_MAGIC:
            schema_id = struct.unpack(">I", data[1:5])[0]
            return self._writer_by_id(schema_id), data[5:]
        raise CodecError(f"inbox record starts with byte 0x{data[0]:02x}: neither Confluent "
                         f"framing (0x00) nor Avro single-object encoding (0xc3 0x01)")


    def _writer_by_id(self, schema_id: int) -> Any:
        writer = self._by_id.get(schema_id)
        if writer is not None:
            return writer
        if self._lookup is None:
            raise SchemaError(f"unknown registry schema id {schema_id} for an inbox record")
        text = self._lookup(schema_id)  # RegistryError when the registry does not know it
        try:
            writer = fastavro.parse_schema(json.loads(text))
        except Exception as exc:  # fastavro's schema errors have no common base
            raise SchemaError(f"registry schema id {schema_id} is not a usable Avro schema: "
                              f"{type(exc).__name__}: {exc}") from None
        self._by_id[schema_id] = writer
        return writer


def _to_record(command: InboxCommand) -> dict[str, Any]:
    obj = command_to_json(command)
    record: dict[str, Any] = {name: None for name in _OPTIONAL_FIELDS}
    for key, value in obj.items():
        record[key] = dumps_json(value) if key in _JSON_FIELDS else value
    return record


def _from_record(record: Mapping[str, Any]) -> InboxCommand:
    obj: dict[str, JsonValue] = {}
    for key, value in record.items():
        if value is None:
            continue
        if key in _JSON_FIELDS:
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise CodecError(f"inbox command field {key!r} is not JSON: {exc}") from None
        obj[key] = value
    try:
        return command_from_json(obj)
    except EventError as exc:
        raise CodecError(f"invalid inbox command: {exc}") from None
    except TypeError as exc:
        raise CodecError(f"invalid inbox command: {exc}") from None
