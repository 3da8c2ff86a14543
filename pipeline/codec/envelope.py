"""The envelope record of a session event <-> :class:`Event`, both ways, on the hot path.

Decoding: :class:`EventRecordBuilder` has the compiled decoder of a writer schema
(:mod:`pipeline.codec.binary`) build ``(session id, Event)`` straight from the envelope's
fields, and the JSON data of every payload (typed records and ``dsh.JsonPayload`` alike), so
no record dict is built in between. A writer schema whose envelope is not the one this code
knows (fields missing, a different ``JsonPayload``) is decoded to the record dict instead and
goes through :func:`event_from_record`, the reference path fastavro-read records take too.

Every envelope rule is the same on both paths: a negative seq or an empty type is refused,
``keyOrder`` may name envelope keys only, ``null`` stays apart from absent.

Encoding: :func:`direct_event_writer` writes an Event's Avro body straight from its fields
(typed payloads by :mod:`pipeline.codec.payload_writer`), for the envelope of schema v2
(:data:`ENVELOPE_V2`). It writes exactly what the record path writes or declines, and the
caller then takes the record path (:class:`pipeline.codec.avro.EventRecords`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

from fastavro.schema import to_parsing_canonical_form

from pipeline.codec.payload import (
    EVENT_TYPES_PROP,
    JSON_PAYLOAD,
    JSON_PROP,
    LONG_MAX,
    LONG_MIN,
    JsonRecordBuilder,
    RecordPlan,
    Unrepresentable,
    json_text,
    parse_json_text,
    payload_branches,
    payload_plans,
)
from pipeline.codec.payload_writer import DirectWriter, direct_writers
from pipeline.codec.payload_writer import write_long as _wlong
from pipeline.core.errors import CodecError
from pipeline.core.events import APPEND, ENVELOPE_KEYS, Event, JsonValue, Replace, SurfaceOp


class WriterPlans(Protocol):
    """What decoding and the direct writer need of a parsed writer schema (the full one is
    :class:`pipeline.codec.schemas.WriterSchema`, which builds on this module)."""

    @property
    def parsed(self) -> dict[str, Any]: ...

    @property
    def plans(self) -> dict[str, RecordPlan]: ...

# The envelope fields a writer schema needs for the direct path; keyOrder came with v2.
ENVELOPE_FIELDS: Final = ("sessionId", "seq", "time", "type", "surfaceOp", "sourceEventSeqs",
                          "ignorable", "payload")
KEY_ORDER_FIELD: Final = "keyOrder"
_EVENT_SLOTS: Final = ("type", "seq", "time", "data", "surface_op", "source_event_seqs",
                       "ignorable", "key_order")


def _slot_setters() -> tuple[Callable[[Event, Any], None], ...] | None:
    """Setters of Event's slots, in constructor order, to build events without the frozen
    dataclass's ``__init__``: it goes through ``object.__setattr__`` per field, which costs
    as much as the rest of decoding a small event, and even a hand-written ``__init__``
    that sets the slots costs a call more than the inlined setters. The objects are
    identical: an Event is a frozen record whose fields are its whole state (logs validate
    events where they are appended, never in the constructor). None (use the constructor)
    should Event change shape or validate in ``__post_init__``."""
    names = tuple(f.name for f in dataclasses.fields(Event))
    if names != _EVENT_SLOTS or getattr(Event, "__slots__", None) != names or hasattr(
            Event, "__post_init__"):
        return None
    return tuple(getattr(Event, name).__set__ for name in names)


EVENT_SETTERS: Final = _slot_setters()


def _event_factory() -> Callable[..., Event]:
    """``Event(type, seq, time, data, op, sources, ignorable, key_order)``, by slot."""
    if EVENT_SETTERS is None:
        return Event
    s_type, s_seq, s_time, s_data, s_op, s_sources, s_ign, s_order = EVENT_SETTERS
    new = object.__new__

    def make_event(type_: str, seq: int, time: int, data: JsonValue, op: SurfaceOp | None,
                   sources: tuple[int, ...] | None, ignorable: bool | None,
                   key_order: tuple[str, ...] | None) -> Event:
        event: Event = new(Event)
        s_type(event, type_)
        s_seq(event, seq)
        s_time(event, time)
        s_data(event, data)
        s_op(event, op)
        s_sources(event, sources)
        s_ign(event, ignorable)
        s_order(event, key_order)
        return event

    return make_event


make_event: Final = _event_factory()


def event_from_record(record: Mapping[str, Any], writer: WriterPlans, *,
                      json_payload: bool = False) -> tuple[str, Event]:
    """(session id, event) from an envelope record read with ``writer`` (record names
    returned, as ``return_record_name=True, return_record_name_override=True`` give them).
    ``json_payload``: typed payloads are already JSON data."""
    seq, type_ = record["seq"], record["type"]
    check_envelope(seq, type_)
    payload = record["payload"]
    if type(payload) is not tuple:
        raise CodecError(f"seq {seq}, type {type_!r}: payload read without its record name")
    name, body = payload
    if name == JSON_PAYLOAD:
        data = parse_json_text(body["data"], "payload")
    elif json_payload:
        data = body
    else:
        plan = writer.plans.get(name)
        if plan is None:
            raise CodecError(f"seq {seq}, type {type_!r}: payload record {name!r} is not in "
                             f"the writer schema")
        data = plan.decode(body)
    sources = record["sourceEventSeqs"]
    op = record["surfaceOp"]
    _check_longs(record, seq, type_)
    return record["sessionId"], make_event(
        type_, seq, record["time"], data, None if op is None else surface_op_from(op),
        None if sources is None else tuple(sources), record["ignorable"],
        key_order_from(record.get(KEY_ORDER_FIELD)))


def _check_longs(record: Mapping[str, Any], seq: int, type_: str) -> None:
    """The envelope's longs are Avro longs. The compiled decoder refuses a wider varint
    where it reads one; a record read by another decoder (fastavro's pure-Python reader
    returns any integer a varint holds) is held to the same rule here, so that no Event is
    built that could not be written back."""
    op = record["surfaceOp"]
    longs = {"seq": seq, "time": record["time"]}
    if isinstance(op, Mapping):
        longs.update({"surfaceOp.start": op["start"], "surfaceOp.end": op["end"]})
    for index, source in enumerate(record["sourceEventSeqs"] or ()):
        longs[f"sourceEventSeqs[{index}]"] = source
    for field, value in longs.items():
        if type(value) is not int or not LONG_MIN <= value <= LONG_MAX:
            raise CodecError(f"seq {seq}, type {type_!r}: {field} {value!r} is not an Avro "
                             f"long (64 bits)")


def check_envelope(seq: int, type_: str) -> None:
    if seq < 0 or not type_:
        raise CodecError(f"seq {seq}, type {type_!r}: decoded an invalid envelope (negative "
                         f"seq or empty type)")


def key_order_from(raw: Any) -> tuple[str, ...] | None:
    # Absent in v1 records. Only envelope keys are accepted; anything else is damage.
    if raw is None:
        return None
    if not isinstance(raw, list) or not ENVELOPE_KEYS.issuperset(raw):
        raise CodecError(f"envelope keyOrder {raw!r} names keys that are not envelope keys")
    return tuple(raw)


def surface_op_from(raw: Any) -> SurfaceOp:
    if raw == APPEND:
        return APPEND
    if isinstance(raw, Mapping):
        return Replace(raw["start"], raw["end"])
    raise CodecError(f"unexpected surfaceOp {raw!r}")


def _is_json_payload(schema: Any) -> bool:
    """``dsh.JsonPayload`` as every committed version has it: one dsh.json field ``data``."""
    if not isinstance(schema, Mapping) or schema.get("name") != JSON_PAYLOAD:
        return False
    fields = schema.get("fields")
    return (isinstance(fields, list) and len(fields) == 1 and fields[0]["name"] == "data"
            and fields[0]["type"] == "string" and fields[0].get(JSON_PROP) is True)


def _payload_field(root: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((f for f in root["fields"] if f["name"] == "payload"), None)


class EventRecordBuilder(JsonRecordBuilder):
    """The record builder of a session-event writer schema: payload records become their
    JSON data (see :class:`JsonRecordBuilder`), ``dsh.JsonPayload`` its parsed text, and the
    envelope ``(session id, Event)``, when the schema's envelope is the known one."""

    def __init__(self, root: Mapping[str, Any], names: frozenset[str]) -> None:
        super().__init__(names)
        self.root = str(root["name"])
        self.direct = self._knows(root)
        self.helpers = {**self.helpers, "_check_env": check_envelope,
                        "_op_from": surface_op_from, "_order_from": key_order_from,
                        "_event": make_event, "_new": object.__new__, "_Event": Event}
        for index, setter in enumerate(EVENT_SETTERS or ()):
            self.helpers[f"_set{index}"] = setter

    @staticmethod
    def _knows(root: Mapping[str, Any]) -> bool:
        present = {f["name"] for f in root["fields"]}
        payload = _payload_field(root)
        if not present.issuperset(ENVELOPE_FIELDS) or payload is None:
            return False
        named = root.get("__named_schemas", {})
        branches = payload["type"] if isinstance(payload["type"], list) else [payload["type"]]
        for branch in branches:
            schema = named.get(branch) if isinstance(branch, str) else branch
            if isinstance(schema, Mapping) and schema.get("name") == JSON_PAYLOAD:
                return _is_json_payload(schema)
        return True

    def untagged(self, record: Mapping[str, Any], field: Mapping[str, Any]) -> bool:
        # The payload's JSON data is all the envelope tail needs, whichever record held it.
        return self.direct and record["name"] == self.root and field["name"] == "payload"

    def tail(self, record: Mapping[str, Any], fields: list[tuple[Mapping[str, Any], str]]
             ) -> list[str] | None:
        name = str(record["name"])
        if self.direct and name == JSON_PAYLOAD:
            return [f"    return _jtext({fields[0][1]}, 'payload'), pos"]
        if self.direct and name == self.root:
            return self._envelope_tail(record, {str(f["name"]): v for f, v in fields})
        return super().tail(record, fields)

    @staticmethod
    def _envelope_tail(record: Mapping[str, Any], var: dict[str, str]) -> list[str]:
        sid, seq, time, type_ = var["sessionId"], var["seq"], var["time"], var["type"]
        op, sources, payload = var["surfaceOp"], var["sourceEventSeqs"], var["payload"]
        order = var.get(KEY_ORDER_FIELD, "None")
        lines = [  # the payload is its JSON data (read untagged, see untagged())
            f"    if {seq} < 0 or not {type_}: _check_env({seq}, {type_})",
            f"    if {op} is not None: {op} = _op_from({op})",
            f"    if {sources} is not None: {sources} = tuple({sources})",
        ]
        if order != "None":
            lines.append(f"    if {order} is not None: {order} = _order_from({order})")
        values = (type_, seq, time, payload, op, sources, var["ignorable"], order)
        if EVENT_SETTERS is None:
            lines.append(f"    return ({sid}, _event({', '.join(values)})), pos")
            return lines
        lines.append("    ev = _new(_Event)")  # make_event, inlined
        lines.extend(f"    _set{index}(ev, {value})" for index, value in enumerate(values))
        lines.append(f"    return ({sid}, ev), pos")
        return lines


# The envelope the direct writer below is written for: schema v2's, payload left out (its
# union is read from the schema). Parsing canonical form, so docs and defaults do not count.
ENVELOPE_V2: Final = (
    '{"name":"dsh.SessionEvent","type":"record","fields":[{"name":"sessionId","type":"string"},'
    '{"name":"seq","type":"long"},{"name":"time","type":"long"},{"name":"type","type":"string"'
    '},{"name":"surfaceOp","type":["null",{"name":"dsh.SurfaceAppend","type":"enum","symbols":'
    '["append"]},{"name":"dsh.SurfaceReplace","type":"record","fields":[{"name":"start","type"'
    ':"long"},{"name":"end","type":"long"}]}]},{"name":"sourceEventSeqs","type":["null",{"type'
    '":"array","items":"long"}]},{"name":"ignorable","type":["null","boolean"]},{"name":"paylo'
    'ad","type":"null"},{"name":"keyOrder","type":["null",{"type":"array","items":"string"}]}]}')
EventWriter = Callable[[bytearray, str, Event], None]
WRITTEN_TEXT_LIMIT: Final = 4096  # session ids and event types remembered as written
# What a direct writer raises when it leaves an event to the record path.
DIRECT_DECLINES: Final = (Unrepresentable, UnicodeEncodeError, ValueError, TypeError,
                          AttributeError, OverflowError, RecursionError)


def _envelope_form(parsed: Mapping[str, Any]) -> str:
    fields = [f if f["name"] != "payload" else {"name": "payload", "type": "null"}
              for f in parsed["fields"]]
    bare = {k: v for k, v in parsed.items() if k != "__named_schemas"}
    return str(to_parsing_canonical_form({**bare, "fields": fields}))


def _decline(buf: bytearray, data: JsonValue) -> None:
    raise Unrepresentable


def direct_event_writer(writer: WriterPlans) -> EventWriter | None:
    """A function writing the Avro body of ``(session id, event)`` with ``writer`` straight
    from the event (no envelope or payload dicts), or None when ``writer``'s envelope is not
    the one it is written for. It writes exactly the bytes of the record path
    (:class:`pipeline.codec.avro.EventRecords` + the compiled codec) or raises one of
    :data:`DIRECT_DECLINES`, leaving the event to that path (which then encodes it
    otherwise, or raises its CodecError)."""
    parsed = writer.parsed
    branches = payload_branches(parsed)
    names = [str(b.get("name")) for b in branches]
    if (_envelope_form(parsed) != ENVELOPE_V2 or JSON_PAYLOAD not in names
            or not _is_json_payload(branches[names.index(JSON_PAYLOAD)]) or len(names) > 64):
        return None
    writers = direct_writers(parsed, payload_plans(parsed)[1])
    typed: dict[str, tuple[int, DirectWriter]] = {}
    for index, branch in enumerate(branches):  # the last record naming a type wins, as in
        for event_type in branch.get(EVENT_TYPES_PROP, ()):  # event_type_plans
            typed[event_type] = (index * 2, writers.get(names[index], _decline))
    return _envelope_writer(names.index(JSON_PAYLOAD) * 2, typed)


def _envelope_writer(json_tag: int, typed: dict[str, tuple[int, DirectWriter]]
                     ) -> EventWriter:
    typed_payload = typed.get
    # Session ids and event types as written (length + UTF-8): each repeats in every event
    # of its session or type, and a lookup costs a third of writing the string.
    written: dict[str, bytes] = {}
    known_text = written.get

    def write(buf: bytearray, session_id: str, event: Event) -> None:
        # The common fields written inline: this runs for every event of every stream.
        raw = known_text(session_id)
        buf += raw if raw is not None else _remember_text(written, session_id)
        seq = event.seq
        if type(seq) is int and 0 <= seq < 64:
            buf.append(seq << 1)
        else:
            _wlong(buf, seq)
        _wlong(buf, event.time)
        type_ = event.type
        raw = known_text(type_)
        buf += raw if raw is not None else _remember_text(written, type_)
        if event.surface_op is None and event.source_event_seqs is None and (
                event.ignorable is None):
            buf += b"\x00\x00\x00"
        else:
            _write_surface(buf, event)
        entry = typed_payload(type_)
        if entry is None:
            buf.append(json_tag)
            _write_text(buf, json_text(event.data))
        else:
            buf.append(entry[0])
            entry[1](buf, event.data)
        if event.key_order is None:
            buf.append(0)
        else:
            _write_key_order(buf, event.key_order)

    return write


def _remember_text(written: dict[str, bytes], text: str) -> bytes:
    """``text`` as Avro writes a string, remembered in ``written`` (bounded: emptied when
    full, so a long-running writer keeps the strings of the sessions it currently sees)."""
    raw = text.encode()
    head = bytearray()
    _wlong(head, len(raw))
    if len(written) >= WRITTEN_TEXT_LIMIT:
        written.clear()
    written[text] = value = bytes(head) + raw
    return value


def _write_text(buf: bytearray, text: str) -> None:
    raw = text.encode()
    if len(raw) < 64:
        buf.append(len(raw) << 1)
    else:
        _wlong(buf, len(raw))
    buf += raw


def _write_key_order(buf: bytearray, order: tuple[str, ...]) -> None:
    buf.append(2)
    if order:
        _wlong(buf, len(order))
        for key in order:
            _write_text(buf, key)
    buf.append(0)


def _write_surface(buf: bytearray, event: Event) -> None:
    """surfaceOp, sourceEventSeqs and ignorable, when one of them is present."""
    op = event.surface_op
    if op is None:
        buf.append(0)
    elif op == APPEND:
        buf += b"\x02\x00"
    elif type(op) is Replace:
        buf.append(4)
        _wlong(buf, op.start)
        _wlong(buf, op.end)
    else:
        raise Unrepresentable
    sources = event.source_event_seqs
    if sources is None:
        buf.append(0)
    else:
        buf.append(2)
        if sources:
            _wlong(buf, len(sources))
            for seq in sources:
                _wlong(buf, seq)
        buf.append(0)
    ignorable = event.ignorable
    if ignorable is None:
        buf.append(0)
    elif ignorable is True:
        buf += b"\x02\x01"
    elif ignorable is False:
        buf += b"\x02\x00"
    else:
        raise Unrepresentable
