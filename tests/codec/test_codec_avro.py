"""Session events through Avro: JSON -> Avro -> JSON is the identity, in both framings."""

from __future__ import annotations

import io
import json
from typing import Any

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_paths import SHARED_DIR
from strategies import lossless_json, valid_logs

from pipeline.codec.avro import EventSerde, event_from_record
from pipeline.codec.payload import JSON_PAYLOAD
from pipeline.codec.records import (
    HEADER_SEQ,
    HEADER_TYPE,
    event_headers,
    header_type_and_seq,
    read_headers,
    record_key,
    session_id_of_key,
)
from pipeline.codec.schemas import SchemaTable, current_event_schema, schema_fingerprint
from pipeline.core.errors import CodecError, SchemaError
from pipeline.core.events import APPEND, Event, JsonValue, Replace, event_from_json

# Both decoders of the session-event schema: compiled, and the generated Python.
pytestmark = pytest.mark.usefixtures("decoder_path")

FIXTURES = (SHARED_DIR / "fixtures")
SINGLE = EventSerde()
CONFLUENT = EventSerde(schema_id=4242)


def fixture_events() -> list[Event]:
    """Every plain event line of the fixtures (not the header, not packed chunk rows)."""
    events = []
    for path in sorted(FIXTURES.glob("**/*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            obj = json.loads(line)
            if "seq" in obj and obj.get("type") != "session":
                events.append(event_from_json(obj))
    return events


def assert_round_trip(event: Event, session_id: str = "s-1") -> None:
    expected = json.dumps(event.to_json(), ensure_ascii=False)
    for serde in (SINGLE, CONFLUENT):
        decoded_id, decoded = serde.decode(serde.encode(session_id, event))
        assert decoded_id == session_id
        assert json.dumps(decoded.to_json(), ensure_ascii=False) == expected
        assert decoded == event


def payload_name(event: Event) -> str:
    return str(SINGLE.records.to_record("s", event)["payload"][0])


@pytest.mark.parametrize("event", fixture_events(), ids=lambda e: f"{e.seq}-{e.type}")
def test_every_fixture_event_round_trips(event: Event) -> None:
    assert_round_trip(event)


def test_core_types_travel_typed_and_others_as_json() -> None:
    names = {e.type: payload_name(e) for e in fixture_events()}
    assert names["turn/start"] == "dsh.TurnStart"
    assert names["step/end"] == "dsh.StepBoundary"
    assert names["turn/end"] == "dsh.TurnEnd"
    assert names["assistant/chunk"] == "dsh.AssistantChunk"
    assert names["assistant/message"] == "dsh.AssistantMessage"
    assert names["user/message"] == "dsh.Message"
    assert names["tool/call"] == "dsh.ToolCall"
    assert names["tool/result"] == "dsh.ToolResult"
    assert names["session/title"] == JSON_PAYLOAD
    assert names["agent/inbox/spliced"] == JSON_PAYLOAD


def test_typed_fields_hold_the_values_downstream_users_need() -> None:
    event = next(e for e in fixture_events() if e.type == "assistant/message"
                 and "usage" in e.data)
    record = SINGLE.records.to_record("s", event)["payload"][1]
    assert record["turn"] == event.data["turn"] and record["step"] == event.data["step"]
    assert record["message"]["role"] == "assistant"
    assert record["message"]["content"][0]["type"] == event.data["message"]["content"][0][
        "type"]
    assert record["usage"]["inputTokens"] == event.data["usage"]["inputTokens"]
    call = next(e for e in fixture_events() if e.type == "tool/call")
    call_record = SINGLE.records.to_record("s", call)["payload"][1]
    assert (call_record["name"], call_record["callId"]) == (call.data["name"],
                                                            call.data["callId"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_logs())
def test_generated_valid_logs_round_trip(events: list[Event]) -> None:
    for event in events:
        assert_round_trip(event)


# Keys that the typed records model, so that generated data hits typed paths with right
# and wrong value types, missing and extra keys, and every key order.
_KEYS = ("turn", "step", "chunk", "reason", "kind", "role", "content", "source", "id", "type",
         "text", "name", "arguments", "toolCallId", "isError", "message", "usage",
         "inputTokens", "outputTokens", "cacheReadTokens", "interrupted", "callId", "error",
         "code", "meta", "provider", "model", "extra", "keyOrder")
_TYPES = ("turn/start", "step/start", "step/end", "turn/end", "assistant/chunk",
          "user/message", "assistant/message", "tool/call", "tool/result", "x/plugin")
_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.integers(-5, 5) | st.floats(allow_nan=False, allow_infinity=False)
            | st.text(max_size=8) | st.sampled_from(_TYPES))


def _json_like() -> st.SearchStrategy[JsonValue]:
    keys = st.sampled_from(_KEYS) | st.text(max_size=5)
    return st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(keys, inner, max_size=6), max_leaves=25)


@st.composite
def tricky_events(draw: Any) -> Event:
    type_ = draw(st.sampled_from(_TYPES) | st.text(min_size=1, max_size=10))
    data = draw(st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=4), _json_like(),
                                max_size=7) | _json_like() | lossless_json())
    op = draw(st.none() | st.just(APPEND) | st.builds(Replace, st.integers(0, 2**40),
                                                      st.integers(0, 2**40)))
    sources = draw(st.none() | st.lists(st.integers(0, 2**62), max_size=4).map(tuple))
    return Event(type_, draw(st.integers(0, 2**63 - 1)), draw(st.integers(-(2**63), 2**63 - 1)),
                 data, op, sources, draw(st.none() | st.booleans()))


@settings(max_examples=150, deadline=None)
@given(tricky_events(), st.text(max_size=20))
def test_any_json_data_round_trips_exactly(event: Event, session_id: str) -> None:
    assert_round_trip(event, session_id)


@pytest.mark.parametrize("data", [
    {"turn": "1"},                          # modeled key of another type
    {"turn": 2**70},                        # does not fit a long
    {"turn": True},                         # a bool is not an int
    {},                                     # required key missing
    [1, 2],                                 # not an object at all
    None,
])
def test_unrepresentable_typed_data_falls_back_to_the_json_payload(data: JsonValue) -> None:
    event = Event("turn/start", 3, 5, data)
    assert payload_name(event) == JSON_PAYLOAD
    assert_round_trip(event)


def test_extra_keys_nulls_and_key_order_are_kept_in_typed_records() -> None:
    data = {"step": 2, "zz": None, "turn": 1, "chunk": {"type": "x", "n": 1.0, "m": 1}}
    event = Event("assistant/chunk", 1, 1, data)
    record = SINGLE.records.to_record("s", event)["payload"]
    assert record[0] == "dsh.AssistantChunk"
    assert record[1]["keyOrder"] == ["step", "zz", "turn", "chunk"]
    assert json.loads(record[1]["extra"]) == {"zz": None}
    assert_round_trip(event)
    message = {"role": "user", "content": [{"type": "new-kind", "blob": [1, 2.5]},
                                           {"text": "t", "type": "text"}],
               "source": {"kind": "plugin", "plugin": "p"}, "id": None}
    event = Event("user/message", 2, 2, message, APPEND, (), False)
    assert payload_name(event) == "dsh.Message"
    assert_round_trip(event)


def test_absent_is_kept_apart_from_null_empty_and_false() -> None:
    for sources, ignorable in ((None, None), ((), False), ((1,), True)):
        event = Event("x/y", 7, 8, {"a": None}, None, sources, ignorable)
        decoded = SINGLE.decode(SINGLE.encode("s", event))[1]
        assert decoded.source_event_seqs == sources and decoded.ignorable is ignorable


def test_strings_utf8_cannot_carry_still_round_trip() -> None:
    event = Event("user/message", 1, 1, {"role": "user", "content": [
        {"type": "text", "text": "lone \ud800 surrogate"}]})
    assert_round_trip(event)
    with pytest.raises(CodecError, match="seq 1"):
        SINGLE.encode("bad \udc00 id", event)


def test_framings_carry_the_id_or_the_fingerprint() -> None:
    event = Event("turn/start", 0, 1, {"turn": 1})
    single = SINGLE.encode("s", event)
    assert single[:2] == b"\xc3\x01"
    assert single[2:10] == current_event_schema().fingerprint
    confluent = CONFLUENT.encode("s", event)
    assert confluent[0] == 0 and confluent[1:5] == (4242).to_bytes(4, "big")
    assert single[10:] == confluent[5:]
    # One decoder accepts both framings.
    assert CONFLUENT.decode(single) == SINGLE.decode(single) == CONFLUENT.decode(confluent)


def test_fingerprint_is_crc64_avro_of_the_canonical_form() -> None:
    assert schema_fingerprint({"type": "record", "name": "x", "fields": []}) \
        == schema_fingerprint({"name": "x", "type": "record", "fields": [], "doc": "ignored"})
    from fastavro.schema import fingerprint
    assert fingerprint('"null"', "CRC-64-AVRO") == "8a8f25cce724dd63"


def test_bad_input_is_a_clear_codec_error() -> None:
    event = Event("turn/start", 0, 1, {"turn": 1})
    good = SINGLE.encode("s", event)
    with pytest.raises(SchemaError, match="unknown writer schema fingerprint"):
        SINGLE.decode(b"\xc3\x01" + bytes(8) + good[10:])
    with pytest.raises(SchemaError, match="unknown registry schema id 7"):
        SINGLE.decode(b"\x00\x00\x00\x00\x07" + good[10:])
    with pytest.raises(CodecError, match="not a framed Avro event"):
        SINGLE.decode(b"{\"type\":1}")
    with pytest.raises(CodecError, match="trailing bytes"):
        SINGLE.decode(good + b"\x00")
    with pytest.raises(CodecError, match=r"truncated|past the end"):
        SINGLE.decode(good[:-1])
    with pytest.raises(CodecError, match="not lossless JSON"):
        SINGLE.encode("s", Event("x/y", 0, 0, {"v": float("nan")}))
    with pytest.raises(CodecError, match="seq"):
        SINGLE.encode("s", Event("x/y", 2**63, 0, {}))


def test_a_registry_lookup_happens_once_per_id() -> None:
    calls: list[int] = []

    def lookup(schema_id: int) -> str:
        calls.append(schema_id)
        return current_event_schema().text()

    reader = EventSerde(SchemaTable(lookup))
    data = EventSerde(schema_id=99).encode("s", Event("turn/start", 0, 1, {"turn": 1}))
    for _ in range(3):
        reader.decode(data)
    assert calls == [99]


def test_record_key_and_headers() -> None:
    event = Event("assistant/chunk", 12, 1, {"turn": 1, "step": 1, "chunk": {}})
    headers = event_headers(event, framing="confluent", traceparent="00-ab-cd-01")
    assert (HEADER_TYPE, b"assistant/chunk") in headers and (HEADER_SEQ, b"12") in headers
    assert header_type_and_seq(headers) == ("assistant/chunk", 12)
    info = read_headers(headers)
    assert (info.framing, info.traceparent) == ("confluent", "00-ab-cd-01")
    assert read_headers(None).type is None
    assert session_id_of_key(record_key("sé-1")) == "sé-1"
    with pytest.raises(CodecError, match=HEADER_SEQ):
        read_headers([(HEADER_SEQ, b"-3")])
    with pytest.raises(CodecError, match="no key"):
        session_id_of_key(None)
    with pytest.raises(CodecError, match="not UTF-8"):
        session_id_of_key(b"\xff")


@settings(max_examples=100, deadline=None)
@given(tricky_events())
def test_compiled_decoder_and_fastavro_with_the_plans_agree(event: Event) -> None:
    """The hot path (payload JSON built inside the compiled decoder) and the reference path
    (fastavro record + RecordPlan.decode, used for container files) give the same event."""
    data = SINGLE.encode("s", event)
    writer = current_event_schema()
    record = fastavro.schemaless_reader(io.BytesIO(data[10:]), writer.parsed, None,
                                        return_record_name=True,
                                        return_record_name_override=True)
    assert event_from_record(record, writer) == SINGLE.decode(data) == ("s", event)


def test_events_built_by_the_decoder_are_the_events_the_constructor_builds() -> None:
    from pipeline.codec.envelope import make_event
    args = ("tool/result", 4, 5, {"a": [1]}, Replace(1, 2), (1, 2), False, ("seq", "type"))
    built, constructed = make_event(*args), Event(*args)
    assert built == constructed and repr(built) == repr(constructed)
    assert hash(make_event("x", 1, 2, None, None, None, None, None)) == hash(
        Event("x", 1, 2, None))
    with pytest.raises(AttributeError):
        built.seq = 9  # type: ignore[misc]


def test_a_writer_schema_with_an_unknown_envelope_shape_still_decodes_exactly() -> None:
    """The direct path (event built inside the compiled decoder) needs the envelope it
    knows; any other writer schema is decoded to a record and through event_from_record."""
    import copy

    from pipeline.codec.avro import EventRecords
    from pipeline.codec.schemas import WriterSchema
    schema = copy.deepcopy(current_event_schema().schema)
    payload = next(f for f in schema["fields"] if f["name"] == "payload")
    json_branch = next(b for b in payload["type"] if b["name"] == "JsonPayload")
    json_branch["fields"].append({"name": "note", "type": ["null", "string"], "default": None})
    evolved = WriterSchema.from_json(schema)
    reader = EventSerde(SchemaTable(lambda schema_id: evolved.text()))
    writer = EventRecords(evolved)
    for event in [*fixture_events()[:30], Event("x/y", 1, 2, [None, 1.5], APPEND, (), True)]:
        framed = bytearray(b"\x00" + (5).to_bytes(4, "big"))
        evolved.binary.encode_into(framed, writer.to_record("s", event))
        assert reader.decode(bytes(framed)) == ("s", event)
    with pytest.raises(CodecError, match="negative seq"):
        framed = bytearray(b"\x00" + (5).to_bytes(4, "big"))
        evolved.binary.encode_into(framed, writer.to_record("s", Event("x/y", -1, 2, {})))
        reader.decode(bytes(framed))
    for bad in (Event("x/y", -1, 2, {}), Event("", 1, 2, {})):  # and on the direct path
        framed = bytearray(SINGLE.prefix)
        SINGLE.writer.binary.encode_into(framed, SINGLE.records.to_record("s", bad))
        with pytest.raises(CodecError, match="invalid envelope"):
            SINGLE.decode(bytes(framed))


def _record_path_bytes(session_id: str, event: Event) -> bytes:
    return SINGLE._encode_record(session_id, event)


def _direct_bytes(session_id: str, event: Event) -> bytes | None:
    from pipeline.codec.envelope import DIRECT_DECLINES
    assert SINGLE._direct is not None
    out = bytearray(SINGLE.prefix)
    try:
        SINGLE._direct(out, session_id, event)
    except DIRECT_DECLINES:
        return None
    return bytes(out)


def test_the_direct_writer_takes_the_fixture_events_and_writes_the_record_paths_bytes() -> None:
    events = fixture_events()
    direct = [_direct_bytes("s-1", e) for e in events]
    assert direct == [d if d is None else _record_path_bytes("s-1", e)
                      for d, e in zip(direct, events, strict=True)]
    # Every typed shape dsh writes goes direct: key orders and extra keys included.
    taken = sum(d is not None for d in direct)
    assert taken >= len(events) - 1, [e.type for d, e in zip(direct, events, strict=True)
                                      if d is None]


@st.composite
def reshaped(draw: Any, value: JsonValue, depth: int = 0) -> JsonValue:
    """``value`` with its objects' keys reordered, some dropped, some added (null, extra
    keys, modeled keys of the wrong type): typed data near the shapes dsh writes."""
    if isinstance(value, list) and depth < 4:
        return [draw(reshaped(item, depth + 1)) for item in value]
    if not isinstance(value, dict) or depth >= 4:
        return value
    items = [(k, draw(reshaped(v, depth + 1))) for k, v in value.items()
             if draw(st.integers(0, 9)) > 0]
    for _ in range(draw(st.integers(0, 2))):
        items.append((draw(st.sampled_from(_KEYS) | st.text(max_size=3)),
                      draw(st.none() | _SCALARS)))
    return dict(draw(st.permutations(items)) if draw(st.booleans()) else items)


@st.composite
def reshaped_fixture_events(draw: Any) -> Event:
    event = draw(st.sampled_from(fixture_events()))
    return Event(event.type, event.seq, event.time, draw(reshaped(event.data)),
                 event.surface_op, event.source_event_seqs, event.ignorable, event.key_order)


@settings(max_examples=300, deadline=None)
@given(st.one_of(tricky_events(), reshaped_fixture_events(), st.sampled_from(fixture_events())),
       st.text(max_size=8))
def test_the_direct_writer_writes_the_record_paths_bytes_or_declines(event: Event,
                                                                     session_id: str) -> None:
    direct = _direct_bytes(session_id, event)
    if direct is not None:
        assert direct == _record_path_bytes(session_id, event)
        assert SINGLE.decode(direct) == (session_id, event)


@settings(max_examples=200, deadline=None)
@given(valid_logs())
def test_the_direct_writer_agrees_on_generated_valid_logs(events: list[Event]) -> None:
    for event in events:
        direct = _direct_bytes("s", event)
        assert direct is None or direct == _record_path_bytes("s", event)
