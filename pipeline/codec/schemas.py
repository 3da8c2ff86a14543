"""The session-event schema, its history, fingerprints and the writer-schema table.

``schemas/dsh.SessionEvent.avsc`` is today's schema; ``schemas/history/`` keeps every
committed version (``dsh.SessionEvent.v<N>.avsc``), because a record on the session topic is
never deleted and must stay readable. A writer schema is found by its CRC-64-AVRO
fingerprint (single-object encoding: looked up among the history) or by its registry id
(Confluent framing: fetched once through a lookup function, then cached).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Final, Generic, Protocol, TypeVar

from fastavro.schema import SchemaParseException, fingerprint, parse_schema
from fastavro.schema import to_parsing_canonical_form as _canonical_form

from pipeline.codec.binary import CompiledSchema
from pipeline.codec.envelope import EventRecordBuilder
from pipeline.codec.payload import RecordPlan, payload_plans
from pipeline.codec.schema_files import schema_dir
from pipeline.core.errors import CodecError, DshError, SchemaError

SCHEMA_DIR: Final = schema_dir()
HISTORY_DIR: Final = SCHEMA_DIR / "history"
EVENT_SCHEMA_FILE: Final = "dsh.SessionEvent.avsc"
EVENT_HISTORY_GLOB: Final = "dsh.SessionEvent.v*.avsc"

SchemaLookup = Callable[[int], str]

# The two framings (DESIGN.md section 2): Confluent = 00 + 4-byte registry id; Avro
# single-object encoding = c3 01 + 8-byte CRC-64-AVRO fingerprint of the writer schema.
CONFLUENT_MAGIC: Final = 0x00
SINGLE_OBJECT_MAGIC: Final = b"\xc3\x01"
CONFLUENT_HEADER_LEN: Final = 5
SINGLE_OBJECT_HEADER_LEN: Final = 10
PREFIX_CACHE_LIMIT: Final = 1024  # distinct framing prefixes a serde remembers


def parse_schema_text(text: str) -> dict[str, Any]:
    """A schema's JSON object from its text (e.g. as a registry returns it)."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise SchemaError(f"schema text is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise SchemaError("schema text is not a JSON object")
    return schema


def parse_record_schema(schema: Mapping[str, Any], what: str) -> dict[str, Any]:
    """fastavro's parsed form of ``schema``, which must be an Avro record (``what`` names it
    in the error)."""
    try:
        parsed: Any = parse_schema(dict(schema))
    except (SchemaParseException, ValueError, TypeError, KeyError) as exc:
        raise SchemaError(f"not a valid Avro schema: {exc}") from None
    if not isinstance(parsed, dict) or parsed.get("type") != "record":
        raise SchemaError(f"{what} must be an Avro record")
    return parsed


class Fingerprinted(Protocol):
    @property
    def fingerprint(self) -> bytes: ...


SchemaT = TypeVar("SchemaT", bound=Fingerprinted)
"""Registry id -> schema text (e.g. ``RegistryClient.get_schema``); raises if unknown."""


def canonical_form(schema: Mapping[str, Any]) -> str:
    """The Avro parsing canonical form (what fingerprints and compatibility are about)."""
    return str(_canonical_form(dict(schema)))


def schema_fingerprint(schema: Mapping[str, Any]) -> bytes:
    """CRC-64-AVRO of the parsing canonical form: the 8 bytes single-object encoding uses."""
    return bytes.fromhex(fingerprint(canonical_form(schema), "CRC-64-AVRO"))


@dataclass(frozen=True, slots=True)
class WriterSchema:
    """A parsed writer schema with what decoding needs, built once."""

    schema: dict[str, Any]
    parsed: dict[str, Any] = field(repr=False)
    fingerprint: bytes
    plans: dict[str, RecordPlan] = field(repr=False)
    # Decodes to (session id, Event) directly, payloads as JSON data (EventRecordBuilder).
    binary: CompiledSchema = field(repr=False)
    version: int | None = None

    @classmethod
    def from_json(cls, schema: Mapping[str, Any], version: int | None = None) -> WriterSchema:
        parsed = parse_record_schema(schema, "a session-event schema")
        plans, payload_records = payload_plans(parsed)
        binary = CompiledSchema(parsed, EventRecordBuilder(parsed, payload_records))
        return cls(dict(schema), parsed, schema_fingerprint(schema), plans, binary, version)

    @classmethod
    def from_text(cls, text: str, version: int | None = None) -> WriterSchema:
        return cls.from_json(parse_schema_text(text), version)

    def text(self) -> str:
        """The schema as JSON text (what gets registered)."""
        return json.dumps(self.schema, separators=(",", ":"))


def read_schema_file(path: Path) -> dict[str, Any]:
    """A schema file's JSON (SchemaError naming the file when it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as handle:
            schema: dict[str, Any] = json.load(handle)
    except (OSError, ValueError) as exc:
        raise SchemaError(f"cannot read schema {path}: {exc}") from None
    return schema


def _version_of(path: Path) -> int:
    stem = path.name.removesuffix(".avsc")
    try:
        return int(stem.rsplit(".v", 1)[1])
    except (IndexError, ValueError):
        raise SchemaError(f"history file {path.name} is not named <name>.v<N>.avsc") from None


@cache
def current_event_schema() -> WriterSchema:
    """Today's session-event schema (the one every writer uses)."""
    return WriterSchema.from_json(read_schema_file(SCHEMA_DIR / EVENT_SCHEMA_FILE))


@cache
def event_schema_history() -> tuple[WriterSchema, ...]:
    """Every committed version of the session-event schema, oldest first."""
    paths = sorted(HISTORY_DIR.glob(EVENT_HISTORY_GLOB), key=_version_of)
    return tuple(WriterSchema.from_json(read_schema_file(p), _version_of(p)) for p in paths)


class KnownSchemaTable(Generic[SchemaT]):
    """Writer schemas by fingerprint (the committed history and today's) and by registry id
    (fetched through ``lookup`` once per unknown id, then cached). Thread-safe."""

    def __init__(self, known: Iterable[SchemaT], parse: Callable[[str], SchemaT],
                 lookup: SchemaLookup | None, kind: str) -> None:
        self._lookup = lookup
        self._parse = parse
        self._kind = kind   # what the schemas are, for error messages
        self._by_fp: dict[bytes, SchemaT] = {}
        self._by_id: dict[int, SchemaT] = {}
        self._lock = threading.Lock()
        for schema in known:
            self._by_fp.setdefault(schema.fingerprint, schema)

    def add_id(self, schema_id: int, schema: SchemaT) -> None:
        """Remember the registry id of a schema (e.g. today's, after registering it)."""
        with self._lock:
            self._by_id[schema_id] = self._by_fp.setdefault(schema.fingerprint, schema)

    def framing_prefix(self, writer: SchemaT, schema_id: int | None) -> bytes:
        """What every value ``writer`` encodes starts with: the Confluent magic byte and
        ``schema_id`` (remembered here) when given, else the single-object marker and the
        writer's fingerprint. Raises CodecError for an id that does not fit 4 bytes."""
        if schema_id is None:
            return SINGLE_OBJECT_MAGIC + writer.fingerprint
        if not 0 <= schema_id < 2**32:
            raise CodecError(f"registry schema id {schema_id} does not fit 4 bytes")
        self.add_id(schema_id, writer)
        return bytes([CONFLUENT_MAGIC]) + schema_id.to_bytes(4, "big")

    def by_fingerprint(self, fp: bytes) -> SchemaT:
        found = self._by_fp.get(fp)
        if found is None:
            raise SchemaError(f"unknown writer schema fingerprint {fp.hex()}: not among the "
                              f"{len(self._by_fp)} known {self._kind} versions in "
                              f"schemas/history/")
        return found

    def by_id(self, schema_id: int) -> SchemaT:
        found = self._by_id.get(schema_id)
        if found is not None:
            return found
        if self._lookup is None:
            raise SchemaError(f"unknown registry schema id {schema_id} (no registry "
                              f"configured to look it up)")
        try:
            text = self._lookup(schema_id)
        except DshError:
            raise  # e.g. RegistryError: the registry is down, which is not a codec problem
        except Exception as exc:  # a foreign lookup function's own error
            raise SchemaError(f"registry schema id {schema_id} could not be fetched: "
                              f"{exc}") from exc
        schema = self._parse(text)
        self.accept(schema_id, schema)
        self.add_id(schema_id, schema)
        return self._by_id[schema_id]

    def accept(self, schema_id: int, schema: SchemaT) -> None:
        """Raise SchemaError when a schema fetched by id is not one of this table's kind."""

    def remember_writer(self, data: bytes, what: str,
                        cache: dict[bytes, tuple[SchemaT, int]]) -> tuple[SchemaT, int]:
        """:meth:`writer_of`, remembered in ``cache`` under the record's framing prefix
        (a serde's own cache: most records share a handful of prefixes)."""
        known = self.writer_of(data, what)
        if len(cache) < PREFIX_CACHE_LIMIT:
            cache[data[:known[1]]] = known
        return known

    def writer_of(self, data: bytes, what: str) -> tuple[SchemaT, int]:
        """The writer schema of framed bytes (either framing) and where the Avro body
        starts; ``what`` names the record in the error (e.g. "event")."""
        if len(data) >= CONFLUENT_HEADER_LEN and data[0] == CONFLUENT_MAGIC:
            return self.by_id(int.from_bytes(data[1:5], "big")), CONFLUENT_HEADER_LEN
        if len(data) >= SINGLE_OBJECT_HEADER_LEN and data[:2] == SINGLE_OBJECT_MAGIC:
            return self.by_fingerprint(data[2:10]), SINGLE_OBJECT_HEADER_LEN
        head = data[:2].hex() or "nothing"
        raise CodecError(f"not a framed Avro {what}: {len(data)} bytes starting with {head} "
                         f"(expected 00 + schema id, or c3 01 + fingerprint)")


class SchemaTable(KnownSchemaTable[WriterSchema]):
    """Session-event writer schemas (see :class:`KnownSchemaTable`)."""

    def __init__(self, lookup: SchemaLookup | None = None,
                 known: tuple[WriterSchema, ...] | None = None) -> None:
        history = known if known is not None else event_schema_history()
        super().__init__((*history, current_event_schema()), WriterSchema.from_text, lookup,
                         "session-event schema")

