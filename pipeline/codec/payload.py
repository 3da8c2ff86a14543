"""Event ``data`` <-> Avro payload records, driven by the schema itself.

Every typed payload record of ``schemas/dsh.SessionEvent.avsc`` follows three conventions, so
that one generic codec can build and read it from the schema alone (no per-type code):

- a field is named after the JSON key it holds; an optional field that is ``null`` means the
  key is absent (a JSON ``null`` value of a modeled key is carried in ``extra`` instead);
- fields carrying the property ``"dsh.json": true`` hold any JSON value as compact JSON text;
- ``extra`` (JSON text of an object, or null) holds every key the record does not model, or
  whose value does not fit the modeled type; ``keyOrder`` (null, or the list of keys) is set
  only when the key order differs from the canonical one: modeled keys in field order, then
  the extra keys in their order.

Because the reading side is generic too, a reader decodes records it was never written for
(a payload record added in a later schema version) from the writer schema alone. When a
record cannot represent some data exactly (a required field missing or of another type),
the encoder says so with :class:`Unrepresentable` and the caller falls back to
``dsh.JsonPayload`` (the data as JSON text).
"""

from __future__ import annotations

import json
import json.encoder
import json.scanner
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from pipeline.core.errors import CodecError
from pipeline.core.events import JsonValue

EXTRA: Final = "extra"
KEY_ORDER: Final = "keyOrder"
JSON_PROP: Final = "dsh.json"
EVENT_TYPES_PROP: Final = "dsh.eventTypes"
JSON_PAYLOAD: Final = "dsh.JsonPayload"
LONG_MIN: Final = -(2**63)
LONG_MAX: Final = 2**63 - 1
LAYOUT_CACHE_LIMIT: Final = 512  # distinct key layouts remembered per record type

def _not_json(value: object) -> object:
    raise TypeError(f"{type(value).__name__} is not JSON")


def _text_encoder(ascii_only: bool) -> Callable[[Any], str]:
    """Compact JSON text, NaN refused, built once: ``JSONEncoder.encode`` would rebuild its
    C encoder on every call, which costs as much as the encoding of a small object."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # an interpreter without the C accelerator
        return json.JSONEncoder(ensure_ascii=ascii_only, separators=(",", ":"),
                                allow_nan=False).encode
    encode = make(None, _not_json, json.encoder.encode_basestring_ascii if ascii_only
                  else json.encoder.encode_basestring, None, ":", ",", False, False, False)

    def text(value: Any) -> str:
        return "".join(encode(value, 0))

    return text


json_text: Final[Callable[[Any], str]] = _text_encoder(ascii_only=False)
json_text_ascii: Final[Callable[[Any], str]] = _text_encoder(ascii_only=True)
_make_scanner: Any = json.scanner.make_scanner  # typeshed types it as a class, oddly
_scan_json: Final[Callable[[str, int], tuple[Any, int]]] = _make_scanner(json.JSONDecoder())


class Unrepresentable(Exception):  # a control-flow signal; never leaves the codec
    """This record type cannot carry that value exactly: use the generic payload."""


def parse_json_text(text: str, where: str) -> JsonValue:
    """Parse JSON text read from Avro; malformed text is a CodecError naming the field."""
    try:
        value, end = _scan_json(text, 0)
    except StopIteration:
        raise CodecError(f"{where}: invalid JSON text in the Avro record") from None
    except (ValueError, RecursionError) as exc:
        raise CodecError(f"{where}: invalid JSON text in the Avro record ({exc})") from None
    if end != len(text):
        raise CodecError(f"{where}: trailing characters after the JSON text")
    return value


# Field kinds.
SCALAR, JSON_FIELD, RECORD, RECORDS, OTHER = range(5)
_SCALAR_TYPES: Final[Mapping[str, type]] = {
    "long": int, "int": int, "string": str, "boolean": bool, "double": float, "float": float,
}


@dataclass(slots=True)
class FieldPlan:
    """How one modeled field maps to its JSON key."""

    key: str
    index: int
    kind: int
    required: bool
    scalar: type | None = None
    sub: RecordPlan | None = None


class RecordPlan:
    """The generic codec of one payload record type (built once per schema)."""

    __slots__ = ("by_key", "fields", "has_extra", "has_order", "layouts", "name", "required")

    def __init__(self, name: str) -> None:
        self.name = name
        self.fields: tuple[FieldPlan, ...] = ()
        self.by_key: dict[str, FieldPlan] = {}
        self.required: tuple[str, ...] = ()
        self.has_extra = False
        self.has_order = False
        # Key tuples seen before whose values all fit: the fast path of encode().
        self.layouts: dict[tuple[str, ...], tuple[tuple[str, FieldPlan], ...]] = {}

    def encode(self, data: JsonValue) -> dict[str, Any]:
        """The Avro record for ``data``; raises Unrepresentable if it cannot be exact."""
        if type(data) is not dict:
            raise Unrepresentable
        layout = self.layouts.get(tuple(data))
        if layout is not None:  # keys seen before: all modeled, in canonical order
            out: dict[str, Any] = {}
            for key, field in layout:
                value = data[key]
                kind = field.kind
                if kind == JSON_FIELD:
                    out[key] = json_text(value)
                    continue
                if kind == SCALAR and type(value) is field.scalar and (
                        type(value) is not int or LONG_MIN <= value <= LONG_MAX):
                    out[key] = value  # inlined: the most common field by far
                    continue
                try:
                    out[key] = _encode_field(field, value)
                except Unrepresentable:
                    break  # a value of another type: the general path sorts it out
            else:
                return out
        return self._encode_general(data)

    def _encode_general(self, data: dict[str, JsonValue]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        extra: dict[str, JsonValue] | None = None
        in_order = True
        last = -1
        by_key = self.by_key
        for key, value in data.items():
            field = by_key.get(key)
            if field is not None:
                try:
                    out[key] = _encode_field(field, value)
                except Unrepresentable:
                    pass
                else:
                    if extra is not None or field.index < last:
                        in_order = False
                    last = field.index
                    continue
            if extra is None:
                extra = {}
            extra[key] = value
        record = self._finish(data, out, extra, in_order)
        if extra is None and in_order and len(self.layouts) < LAYOUT_CACHE_LIMIT:
            self.layouts[tuple(data)] = tuple((key, by_key[key]) for key in data)
        return record

    def _finish(self, data: dict[str, JsonValue], out: dict[str, Any],
                extra: dict[str, JsonValue] | None, in_order: bool) -> dict[str, Any]:
        for key in self.required:
            if key not in out:
                raise Unrepresentable
        if extra is not None:
            if not self.has_extra:
                raise Unrepresentable
            out[EXTRA] = json_text(extra)
        if not in_order:
            if not self.has_order:
                raise Unrepresentable
            out[KEY_ORDER] = list(data)
        return out

    def decode(self, record: Mapping[str, Any]) -> dict[str, JsonValue]:
        """The JSON object ``record`` stands for (the exact one it was built from)."""
        out: dict[str, JsonValue] = {}
        for field in self.fields:
            value = record.get(field.key)
            if value is None:
                continue
            kind = field.kind
            if kind == SCALAR:  # inlined: the most common field by far
                out[field.key] = value
            elif kind == JSON_FIELD:
                out[field.key] = parse_json_text(value, field.key)
            else:
                out[field.key] = _decode_field(field, value, self.name)
        if self.has_extra:
            extra = record.get(EXTRA)
            if extra is not None:
                more = parse_json_text(extra, f"{self.name}.extra")
                if type(more) is not dict:
                    raise CodecError(f"{self.name}.extra: expected a JSON object")
                out.update(more)
        if self.has_order:
            order = record.get(KEY_ORDER)
            if order is not None:
                out = _reorder(out, order, self.name)
        return out


def _reorder(out: dict[str, JsonValue], order: list[str], name: str) -> dict[str, JsonValue]:
    try:  # the loop in C: every message dsh writes has its keys in another order
        ordered = dict(zip(order, map(out.__getitem__, order), strict=True))
    except (KeyError, TypeError):
        ordered = {}
    if len(ordered) != len(out) or len(order) != len(out):
        raise CodecError(f"{name}.keyOrder does not list exactly the record's keys")
    return ordered


def _encode_field(field: FieldPlan, value: JsonValue) -> Any:
    kind = field.kind
    if kind == SCALAR:
        if type(value) is not field.scalar:
            raise Unrepresentable
        if type(value) is int and not LONG_MIN <= value <= LONG_MAX:
            raise Unrepresentable
        return value
    if kind == JSON_FIELD:
        return json_text(value)
    assert field.sub is not None
    if kind == RECORD:
        return field.sub.encode(value)
    if kind == RECORDS:
        if type(value) is not list:
            raise Unrepresentable
        encode = field.sub.encode
        return [encode(item) for item in value]
    raise Unrepresentable


def _decode_field(field: FieldPlan, value: Any, where: str) -> JsonValue:
    kind = field.kind
    if kind in (SCALAR, OTHER):
        return value
    if kind == JSON_FIELD:
        return parse_json_text(value, f"{where}.{field.key}")
    assert field.sub is not None
    if kind == RECORD:
        return field.sub.decode(value)
    decode = field.sub.decode
    return [decode(item) for item in value]


class PlanBuilder:
    """Builds the RecordPlans of a parsed (fastavro) schema's named records."""

    def __init__(self, named: Mapping[str, Any]) -> None:
        self._named = named
        self.plans: dict[str, RecordPlan] = {}

    def plan(self, name: str) -> RecordPlan:
        existing = self.plans.get(name)
        if existing is not None:
            return existing
        schema = self._named.get(name)
        if not isinstance(schema, Mapping) or schema.get("type") != "record":
            raise CodecError(f"schema names no record {name!r}")
        plan = RecordPlan(name)
        self.plans[name] = plan  # before the fields: a record may refer to itself
        fields: list[FieldPlan] = []
        for field in schema["fields"]:
            field_name = field["name"]
            if field_name == EXTRA:
                plan.has_extra = True
            elif field_name == KEY_ORDER:
                plan.has_order = True
            else:
                fields.append(self._field(field, len(fields)))
        plan.fields = tuple(fields)
        plan.by_key = {f.key: f for f in fields}
        plan.required = tuple(f.key for f in fields if f.required)
        return plan

    def _field(self, field: Mapping[str, Any], index: int) -> FieldPlan:
        avro_type = field["type"]
        required = True
        if isinstance(avro_type, list):
            branches = [b for b in avro_type if b != "null"]
            required = len(branches) == len(avro_type)
            avro_type = branches[0] if len(branches) == 1 else None
        plan = FieldPlan(field["name"], index, OTHER, required)
        if field.get(JSON_PROP) is True:
            plan.kind = JSON_FIELD
        elif isinstance(avro_type, str) and avro_type in _SCALAR_TYPES:
            plan.kind, plan.scalar = SCALAR, _SCALAR_TYPES[avro_type]
        elif isinstance(avro_type, str) and avro_type in self._named:
            plan.kind, plan.sub = RECORD, self.plan(avro_type)
        elif isinstance(avro_type, Mapping) and avro_type.get("type") == "record":
            plan.kind, plan.sub = RECORD, self.plan(avro_type["name"])
        elif isinstance(avro_type, Mapping) and avro_type.get("type") == "array":
            items = avro_type["items"]
            item_name = items["name"] if isinstance(items, Mapping) else items
            if isinstance(item_name, str) and item_name in self._named:
                plan.kind, plan.sub = RECORDS, self.plan(item_name)
        return plan


def payload_branches(parsed: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The record schemas of the envelope's ``payload`` union (named refs resolved)."""
    named = parsed.get("__named_schemas", {})
    for field in parsed["fields"]:
        if field["name"] == "payload":
            branches = field["type"] if isinstance(field["type"], list) else [field["type"]]
            return [named[b] if isinstance(b, str) else b for b in branches]
    raise CodecError(f"schema {parsed.get('name')!r} has no 'payload' field")


def event_type_plans(parsed: Mapping[str, Any]) -> dict[str, RecordPlan]:
    """Event type -> the typed record that carries it (from ``dsh.eventTypes``)."""
    builder = PlanBuilder(parsed.get("__named_schemas", {}))
    out: dict[str, RecordPlan] = {}
    for branch in payload_branches(parsed):
        for event_type in branch.get(EVENT_TYPES_PROP, ()):
            out[event_type] = builder.plan(branch["name"])
    return out


def payload_plans(parsed: Mapping[str, Any]) -> tuple[dict[str, RecordPlan], frozenset[str]]:
    """Record name -> plan for every typed payload branch of a writer schema, and the names
    of every record inside them too (the records that follow the payload conventions)."""
    builder = PlanBuilder(parsed.get("__named_schemas", {}))
    branches = {b["name"]: builder.plan(b["name"]) for b in payload_branches(parsed)
                if b.get("type") == "record" and b["name"] != JSON_PAYLOAD}
    return branches, frozenset(builder.plans)


def _merge_extra(out: dict[str, JsonValue], text: str, name: str) -> None:
    more = parse_json_text(text, f"{name}.extra")
    if type(more) is not dict:
        raise CodecError(f"{name}.extra: expected a JSON object")
    out.update(more)


class JsonRecordBuilder:
    """Has the compiled decoder (:mod:`pipeline.codec.binary`) build the JSON data of payload
    records directly, with exactly :meth:`RecordPlan.decode`'s rules, skipping the record
    dict in between (decoding is the hot path of every consumer)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.helpers: Mapping[str, Any] = {
            "_jtext": parse_json_text, "_jextra": _merge_extra, "_jorder": _reorder}

    def untagged(self, record: Mapping[str, Any], field: Mapping[str, Any]) -> bool:
        return False

    def tail(self, record: Mapping[str, Any], fields: list[tuple[Mapping[str, Any], str]]
             ) -> list[str] | None:
        name = str(record["name"])
        if name not in self.names:
            return None
        leading: list[str] = []  # required fields before any optional one: a dict literal
        lines: list[str] = []
        extra = order = None
        for field, var in fields:
            key = str(field["name"])
            if key == EXTRA:
                extra = var
            elif key == KEY_ORDER:
                order = var
            else:
                value = f"_jtext({var}, {key!r})" if field.get(JSON_PROP) is True else var
                required = not isinstance(field["type"], list) and field["type"] != "null"
                if required and not lines:
                    leading.append(f"{key!r}: {value}")
                elif required:
                    lines.append(f"    out[{key!r}] = {value}")
                else:
                    lines.append(f"    if {var} is not None: out[{key!r}] = {value}")
        lines.insert(0, f"    out = {{{', '.join(leading)}}}")
        if extra is not None:
            lines.append(f"    if {extra} is not None: _jextra(out, {extra}, {name!r})")
        if order is not None:
            lines.append(f"    if {order} is not None: out = _jorder(out, {order}, {name!r})")
        lines.append("    return out, pos")
        return lines
