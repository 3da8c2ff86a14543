"""The processors' derived outputs as Avro: derived-message changes, usage records, fleet status.

Schemas (``schemas/``, every version in ``schemas/history/``):

- ``dsh.DerivedMessageChange`` for ``derived-messages`` (and its rebuilt versions);
- ``dsh.UsageRecord`` for ``usage`` (session, model and window records);
- ``dsh.FleetStatus`` for ``fleet``.

A decoded record is the same JSON object the processors published before the outputs were
Avro (and still serve over HTTP), so readers see no difference. The schema says how:

- a field holds the JSON key named by its ``dsh.name`` attribute, or its own name (usage
  fields are the OpenTelemetry GenAI names with dots as underscores: Avro names cannot
  contain dots, e.g. ``gen_ai_usage_input_tokens`` <-> ``gen_ai.usage.input_tokens``);
- a field with ``"dsh.json": true`` holds any JSON value as compact JSON text (the derived
  message itself: lossless, as the session-event schema's ``JsonPayload``);
- a null optional field is an absent key, unless the record says ``"dsh.nullIsValue": true``
  (fleet status: every key is always there, null is a value).

Framings are those of the session topic (:mod:`pipeline.codec.avro`): Confluent (``00`` +
registry id) when a serde is given its registry id, else single-object encoding (``C3 01`` +
fingerprint). The decoder accepts both, decodes with the *writer* schema (found by
fingerprint among every committed version, or by registry id through a lookup) and, for
topics written before the outputs were Avro, a compact JSON object (first byte ``{``).
Tombstones stay null values: ``None`` in, ``None`` out. Every failure is a
:class:`CodecError` (or :class:`SchemaError`) naming what was wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Final

from pipeline.codec.binary import CompiledSchema
from pipeline.codec.payload import json_text, json_text_ascii, parse_json_text
from pipeline.codec.schemas import (
    HISTORY_DIR,
    SCHEMA_DIR,
    KnownSchemaTable,
    SchemaLookup,
    parse_record_schema,
    parse_schema_text,
    read_schema_file,
    schema_fingerprint,
)
from pipeline.core.errors import CodecError, SchemaError
from pipeline.core.events import JsonValue
from pipeline.core.projection import MessageChange

DERIVED_MESSAGE_CHANGE: Final = "dsh.DerivedMessageChange"
USAGE_RECORD: Final = "dsh.UsageRecord"
FLEET_STATUS: Final = "dsh.FleetStatus"
OUTPUT_SCHEMAS: Final = (DERIVED_MESSAGE_CHANGE, USAGE_RECORD, FLEET_STATUS)


@dataclass(frozen=True, slots=True)
class _Field:
    avro: str       # the Avro field name
    key: str        # the JSON key it holds
    json_text: bool  # any JSON value as compact JSON text
    nullable: bool  # a ["null", T] union


class OutputSchema:
    """One version of an output record schema, compiled, with its JSON mapping."""

    def __init__(self, schema: Mapping[str, Any], version: int | None = None) -> None:
        parsed = parse_record_schema(schema, "an output schema")
        self.schema = dict(schema)
        self.name: str = parsed["name"]
        self.version = version
        self.fingerprint = schema_fingerprint(schema)
        self.binary = CompiledSchema(parsed)
        self.null_is_value = bool(schema.get("dsh.nullIsValue", False))
        self.fields = tuple(_Field(f["name"], f.get("dsh.name", f["name"]),
                                   bool(f.get("dsh.json", False)),
                                   isinstance(f["type"], list) and "null" in f["type"])
                            for f in schema["fields"])
        self._by_key = {f.key: f for f in self.fields}

    @classmethod
    def from_text(cls, text: str) -> OutputSchema:
        return cls(parse_schema_text(text))

    def text(self) -> str:
        """The schema as JSON text (what gets registered)."""
        return json.dumps(self.schema, separators=(",", ":"))

    def to_record(self, value: Mapping[str, JsonValue], *, ascii_json: bool = False
                  ) -> dict[str, Any]:
        """The Avro record of a JSON object; a key the schema does not hold is an error
        (nothing is dropped silently)."""
        unknown = [key for key in value if key not in self._by_key]
        if unknown:
            raise CodecError(f"{self.name}: keys {unknown} are not fields of the schema")
        self._check_presence(value)
        text = json_text_ascii if ascii_json else json_text
        record: dict[str, Any] = {}
        for f in self.fields:
            item = value.get(f.key)
            if f.json_text and f.key in value:
                try:
                    item = text(item)
                except (ValueError, TypeError, RecursionError) as exc:
                    raise CodecError(f"{self.name}.{f.avro}: not lossless JSON: "
                                     f"{exc}") from None
            record[f.avro] = item
        return record

    def _check_presence(self, value: Mapping[str, JsonValue]) -> None:
        """Refuse what the decoded record could not give back: a required key missing or
        null, and where null means absent, a key present with null (or, where null is a
        value, a key missing)."""
        missing = [f.key for f in self.fields if (not f.nullable or self.null_is_value)
                   and f.key not in value]
        nulls = [f.key for f in self.fields if value.get(f.key, 0) is None and not f.json_text
                 and (not f.nullable or not self.null_is_value)]
        if missing or nulls:
            raise CodecError(f"{self.name}: keys {missing} are missing, keys {nulls} are null; "
                             f"decoding would not give this object back")

    def from_record(self, record: Mapping[str, Any]) -> dict[str, JsonValue]:
        """The JSON object of a decoded record (keys in field order)."""
        out: dict[str, JsonValue] = {}
        keep_null = self.null_is_value
        for f in self.fields:
            item = record[f.avro]
            if item is None and f.nullable and not keep_null:
                continue  # an absent key
            if f.json_text:
                item = parse_json_text(item, f"{self.name}.{f.avro}")
            out[f.key] = item
        return out


@cache
def current_output_schema(name: str) -> OutputSchema:
    """Today's version of an output schema (``name``: one of :data:`OUTPUT_SCHEMAS`)."""
    if name not in OUTPUT_SCHEMAS:
        raise SchemaError(f"{name!r} is not an output schema (one of {OUTPUT_SCHEMAS})")
    return OutputSchema(read_schema_file(SCHEMA_DIR / f"{name}.avsc"))


@cache
def output_schema_history(name: str) -> tuple[OutputSchema, ...]:
    """Every committed version of an output schema, oldest first."""
    found = []
    for path in HISTORY_DIR.glob(f"{name}.v*.avsc"):
        version = path.name.removesuffix(".avsc").rsplit(".v", 1)[1]
        if not version.isdigit():
            raise SchemaError(f"history file {path.name} is not named <name>.v<N>.avsc")
        found.append(OutputSchema(read_schema_file(path), int(version)))
    return tuple(sorted(found, key=lambda s: s.version or 0))


class OutputSchemaTable(KnownSchemaTable[OutputSchema]):
    """Writer schemas of every output record (see
    :class:`~pipeline.codec.schemas.KnownSchemaTable`)."""

    def __init__(self, lookup: SchemaLookup | None = None) -> None:
        super().__init__((schema for name in OUTPUT_SCHEMAS
                          for schema in (*output_schema_history(name),
                                         current_output_schema(name))),
                         OutputSchema.from_text, lookup, "output schema")

    def accept(self, schema_id: int, schema: OutputSchema) -> None:
        if schema.name not in OUTPUT_SCHEMAS:
            raise SchemaError(f"registry schema id {schema_id} is {schema.name}, not an "
                              f"output record schema")


class OutputDecoder:
    """Decodes a record of any output topic (either framing, any version, legacy JSON)."""

    def __init__(self, table: OutputSchemaTable | None = None) -> None:
        self.table = table or OutputSchemaTable()
        self._by_prefix: dict[bytes, tuple[OutputSchema, int]] = {}

    def decode(self, data: bytes | None, expect: str | None = None
               ) -> dict[str, JsonValue] | None:
        """The JSON object of a record value; ``None`` for a tombstone. With ``expect`` (a
        schema name), a record of another output schema is an error."""
        if data is None:
            return None
        if not isinstance(data, bytes):
            data = _as_bytes(data)
        known = self._by_prefix.get(data[:10]) or self._by_prefix.get(data[:5])
        if known is None:
            if data[:1] == b"{":
                return _legacy_json(data)
            known = self._learn_prefix(data)
        schema, start = known
        if expect is not None and schema.name != expect:
            raise CodecError(f"a {schema.name} record where {expect} was expected")
        return schema.from_record(schema.binary.decode(data, start))

    def schema_of(self, data: bytes) -> OutputSchema:
        """The writer schema of framed bytes (e.g. to check which record a topic holds)."""
        return self._writer_of(_as_bytes(data))[0]

    def _learn_prefix(self, data: bytes) -> tuple[OutputSchema, int]:
        return self.table.remember_writer(data, "output record", self._by_prefix)

    def _writer_of(self, data: bytes) -> tuple[OutputSchema, int]:
        return self.table.writer_of(data, "output record")


class OutputSerde(OutputDecoder):
    """Writes one output record type with today's schema; decodes any output record.

    Confluent-framed when given the registry id of today's schema (registered under the
    topic's subject), else single-object encoding. Thread-safe; build one per topic.
    """

    def __init__(self, name: str, *, schema_id: int | None = None,
                 table: OutputSchemaTable | None = None) -> None:
        super().__init__(table)
        self.writer = current_output_schema(name)
        self.prefix = self.table.framing_prefix(self.writer, schema_id)
        self.schema_id = schema_id

    def encode(self, value: Mapping[str, JsonValue] | None) -> bytes | None:
        """The framed bytes of a JSON object; ``None`` (a tombstone) stays ``None``."""
        if value is None:
            return None
        return self._encode_record(value, lambda ascii_json: self.writer.to_record(
            value, ascii_json=ascii_json))

    def _encode_record(self, value: object, record: Callable[[bool], dict[str, Any]]) -> bytes:
        out = bytearray(self.prefix)
        try:
            self.writer.binary.encode_into(out, record(False))
        except UnicodeEncodeError:  # a lone surrogate: JSON text can carry it escaped
            out = bytearray(self.prefix)
            try:
                self.writer.binary.encode_into(out, record(True))
            except UnicodeEncodeError as exc:
                raise CodecError(f"{self.writer.name}: a string UTF-8 cannot encode outside "
                                 f"the JSON fields: {exc}") from None
        except CodecError as exc:
            raise CodecError(f"{self.writer.name}: cannot encode {str(value)[:200]}: "
                             f"{exc}") from None
        return bytes(out)


class DerivedChangeSerde(OutputSerde):
    """The derived-messages serde, with the hot path of the processors: a change's record
    built straight from the :class:`MessageChange` (no intermediate JSON object)."""

    def __init__(self, *, schema_id: int | None = None,
                 table: OutputSchemaTable | None = None) -> None:
        super().__init__(DERIVED_MESSAGE_CHANGE, schema_id=schema_id, table=table)

    def encode_change(self, change: MessageChange) -> bytes | None:
        """The framed bytes of a change; ``None`` for a removal (a tombstone)."""
        if change.kind == "remove":
            return None
        out = bytearray(self.prefix)
        try:  # the usual case, once; anything unusual is decided by the general path
            self.writer.binary.encode_into(out, _change_record(change, json_text))
            return bytes(out)
        except (CodecError, UnicodeEncodeError, ValueError, TypeError, RecursionError):
            pass
        return self._encode_record(change, lambda ascii_json: _change_record(
            change, json_text_ascii if ascii_json else json_text, checked=True))


def _change_record(change: MessageChange, text: Callable[[Any], str], *,
                   checked: bool = False) -> dict[str, Any]:
    try:
        message = text(change.message)
    except (ValueError, TypeError, RecursionError) as exc:
        if not checked:
            raise
        raise CodecError(f"message is not lossless JSON: {exc}") from None
    return {"session": change.session_id, "slot": change.slot, "seq": change.seq,
            "changeSeq": change.change_seq, "op": change.kind, "message": message}


@dataclass(frozen=True, slots=True)
class OutputCodecs:
    """The serdes of the three output topics, sharing one schema table."""

    derived: DerivedChangeSerde
    usage: OutputSerde
    fleet: OutputSerde

    @classmethod
    def single_object(cls) -> OutputCodecs:
        """No registry: single-object encoding (the local demo's default)."""
        table = OutputSchemaTable()
        return cls(DerivedChangeSerde(table=table), OutputSerde(USAGE_RECORD, table=table),
                   OutputSerde(FLEET_STATUS, table=table))

    @classmethod
    def confluent(cls, ids: Mapping[str, int], lookup: SchemaLookup | None) -> OutputCodecs:
        """Confluent framing with the registry ids of today's schemas (by schema name)."""
        table = OutputSchemaTable(lookup)
        return cls(DerivedChangeSerde(schema_id=ids[DERIVED_MESSAGE_CHANGE], table=table),
                   OutputSerde(USAGE_RECORD, schema_id=ids[USAGE_RECORD], table=table),
                   OutputSerde(FLEET_STATUS, schema_id=ids[FLEET_STATUS], table=table))


@cache
def default_output_codecs() -> OutputCodecs:
    """One shared single-object set (the serdes are thread-safe)."""
    return OutputCodecs.single_object()


def _legacy_json(data: bytes) -> dict[str, JsonValue]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CodecError(f"output record starting with '{{' is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CodecError("output record JSON is not an object")
    return value


def _as_bytes(data: object) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, bytearray | memoryview):
        return bytes(data)
    raise CodecError(f"expected bytes to decode, got {type(data).__name__}")
