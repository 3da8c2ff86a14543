"""Random and mutated bytes never crash the decoders: always a CodecError, never another."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Final

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from shared_paths import SHARED_DIR

from pipeline.codec.avro import EventSerde, event_from_record
from pipeline.codec.binary import CompiledSchema
from pipeline.codec.container import read_container, write_container
from pipeline.codec.schemas import current_event_schema
from pipeline.core.errors import CodecError
from pipeline.core.events import Event, Replace, event_from_json

# Both decoders of the session-event schema: compiled, and the generated Python.
pytestmark = pytest.mark.usefixtures("decoder_path")

FIXTURES = (SHARED_DIR / "fixtures/dsh-format0")
SERDE = EventSerde(schema_id=1)


def _events() -> list[Event]:
    lines = (FIXTURES / "tool-call-turn.jsonl").read_text(encoding="utf-8").splitlines()
    return [event_from_json(obj) for obj in map(json.loads, lines) if "seq" in obj]


EVENTS = _events()
ENCODED = [SERDE.encode("session-1", e) for e in EVENTS] + [
    EventSerde().encode("session-1", e) for e in EVENTS]


def _decode_or_codec_error(data: bytes) -> None:
    try:
        session_id, event = SERDE.decode(data)
    except CodecError:
        return
    # Whatever decodes is a well-formed event again.
    assert isinstance(session_id, str) and event.seq >= 0 and event.type
    SERDE.encode(session_id, event)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes(data: bytes) -> None:
    _decode_or_codec_error(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.sampled_from([b"\x00\x00\x00\x00\x01",
                                                b"\xc3\x01" + current_event_schema().fingerprint]))
def test_random_bodies_behind_valid_framing(body: bytes, prefix: bytes) -> None:
    _decode_or_codec_error(prefix + body)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(ENCODED)))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "cut", "insert", "widen", "delete"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if action == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif action == "cut":
            del data[pos:]
        elif action == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif action == "widen":  # continuation bytes: a varint grows past its field
            data[pos:pos] = bytes(b | 0x80 for b in draw(st.binary(min_size=1, max_size=5)))
        elif data:
            del data[pos]
    return bytes(data)


# What the test once found (issue 3), as hypothesis shrank it: the first event of
# tool-call-turn.jsonl, Confluent-framed, with 80 80 80 80 inserted at the start of its time
# varint. The varint is then 10 bytes whose last one (67) sets bits 63 to 69: decoded as a
# Python integer, time was 479291174944726056960, and writing the event back failed.
TIME_BEYOND_64_BITS: Final = bytes.fromhex(
    "00000000011273657373696f6e2d310080808080808ea880f767266167656e742f696e626f782f73706c6963"
    "65640000000094047b22746172676574223a226e6578742d7475726e222c227374617274223a302c22696e73"
    "6572746564223a5b7b22636f6e74656e74223a5b7b2274797065223a2274657874222c2274657874223a2255"
    "736520746865206261736820746f6f6c20746f2072756e2065786163746c793a206563686f20534e41505348"
    "4f545f4f4b2e205468656e207265706c792077697468207468652073696e676c6520776f726420444f4e4520"
    "616e642073746f702e227d5d2c22736f75726365223a7b226b696e64223a2275736572227d2c22726f6c6522"
    "3a2275736572222c226964223a2266653437396161302d313139342d343066622d383937622d626337663939"
    "623534313438227d5d7d00")


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
@example(TIME_BEYOND_64_BITS)
def test_mutated_encodings(data: bytes) -> None:
    _decode_or_codec_error(data)


def test_the_time_beyond_64_bits_is_refused_naming_the_field() -> None:
    assert TIME_BEYOND_64_BITS.replace(b"\x80" * 4, b"", 1) == ENCODED[0]
    with pytest.raises(CodecError, match=r"dsh\.SessionEvent\.time: varint of 70 bits"):
        SERDE.decode(TIME_BEYOND_64_BITS)


def _event_bytes(seq: bytes = b"\x00", time: bytes = b"\x02", surface: bytes = b"\x00\x00"
                 ) -> bytes:
    """A Confluent-framed event written by hand: session 's', type 'x/y', data {} (the
    JsonPayload branch, index 0), with the given seq and time varints and surfaceOp +
    sourceEventSeqs bytes."""
    return (b"\x00\x00\x00\x00\x01" + b"\x02s" + seq + time + b"\x06x/y" + surface
            + b"\x00" + b"\x00\x04{}" + b"\x00")


ZERO_10_BYTES: Final = b"\x80" * 9 + b"\x00"  # longest encodings of a value that fits
LONG_MAX_VARINT: Final = b"\xfe" + b"\xff" * 8 + b"\x01"
LONG_MIN_VARINT: Final = b"\xff" * 9 + b"\x01"
BIT_64_VARINT: Final = b"\x80" * 9 + b"\x02"  # 2**64 as written: one bit too many
ALL_70_BITS_VARINT: Final = b"\xff" * 9 + b"\x7f"
ELEVEN_BYTES_VARINT: Final = b"\x80" * 10 + b"\x00"


def test_the_hand_written_event_decodes() -> None:
    assert SERDE.decode(_event_bytes()) == ("s", Event("x/y", 0, 1, {}))


@pytest.mark.parametrize(("varint", "value"), [
    (ZERO_10_BYTES, 0), (LONG_MAX_VARINT, 2**63 - 1), (LONG_MIN_VARINT, -(2**63))])
def test_ten_byte_varints_within_64_bits_decode_and_write_back(varint: bytes, value: int
                                                               ) -> None:
    session_id, event = SERDE.decode(_event_bytes(time=varint))
    assert event == Event("x/y", 0, value, {})
    assert SERDE.decode(SERDE.encode(session_id, event)) == (session_id, event)


def _replace(start: bytes) -> bytes:
    return b"\x04" + start + b"\x02\x00"  # surfaceOp Replace(start, 1), no sourceEventSeqs


def _sources(item: bytes) -> bytes:
    return b"\x00\x02\x02" + item + b"\x00"  # no surfaceOp, sourceEventSeqs [item]


@pytest.mark.parametrize(("varint", "message"), [
    (BIT_64_VARINT, "varint of 65 bits, more than the 64 of an Avro long"),
    (ALL_70_BITS_VARINT, "varint of 70 bits"),
    (ELEVEN_BYTES_VARINT, "varint longer than 10 bytes")])
@pytest.mark.parametrize(("field", "place"), [
    ("seq", lambda v: _event_bytes(seq=v)),
    ("time", lambda v: _event_bytes(time=v)),
    ("SurfaceReplace.start", lambda v: _event_bytes(surface=_replace(v))),
    (r"sourceEventSeqs\[\]", lambda v: _event_bytes(surface=_sources(v)))])
def test_envelope_longs_beyond_64_bits_are_refused_naming_the_field(
        varint: bytes, message: str, field: str, place: Callable[[bytes], bytes]) -> None:
    with pytest.raises(CodecError, match=rf"{field}: {message}"):
        SERDE.decode(place(varint))
    SERDE.decode(place(b"\x02"))  # the same event with a small value decodes


def test_the_record_path_refuses_longs_beyond_64_bits_naming_the_field() -> None:
    """A record read by another decoder (fastavro's pure-Python reader takes any varint)
    is held to the same rule before it becomes an Event."""
    writer = current_event_schema()
    event = Event("x/y", 3, 1, {}, Replace(0, 1), (0, 1))
    record = SERDE.records.to_record("s", event)
    assert event_from_record(record, writer) == ("s", event)
    for field, changed in (("time", {"time": 2**64}), ("seq", {"seq": 2**63}),
                           ("surfaceOp.end", {"surfaceOp": {"start": 0, "end": -(2**63) - 1}}),
                           (r"sourceEventSeqs\[1\]", {"sourceEventSeqs": [0, 2**70]})):
        with pytest.raises(CodecError, match=rf"{field} -?\d+ is not an Avro long"):
            event_from_record({**record, **changed}, writer)


_PLAIN_DECODERS: dict[bytes, CompiledSchema] = {}


def _record_path(data: bytes) -> tuple[str, Event]:
    """The reference path: the writer schema compiled without the event builder (records
    as dicts, payloads as records), then event_from_record and the payload plans."""
    writer, start = SERDE.writer_of(data)
    plain = _PLAIN_DECODERS.get(writer.fingerprint)
    if plain is None:
        plain = _PLAIN_DECODERS[writer.fingerprint] = CompiledSchema(writer.parsed)
    return event_from_record(plain.decode(data, start), writer)


def _outcome(decode: Callable[[bytes], tuple[str, Event]], data: bytes) -> str:
    try:
        session_id, event = decode(data)
    except CodecError:
        return "refused"
    return repr((session_id, event))  # repr: key order counts, and NaN equals NaN


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
@example(TIME_BEYOND_64_BITS)
@example(_event_bytes(time=BIT_64_VARINT))
@example(_event_bytes(time=LONG_MIN_VARINT))
@example(_event_bytes(surface=_sources(ELEVEN_BYTES_VARINT)))
def test_the_direct_decoder_and_the_record_path_decide_alike(data: bytes) -> None:
    """The event the compiled decoder builds itself (EventRecordBuilder) and the one
    event_from_record builds from the record: the same, or both refused."""
    assert _outcome(SERDE.decode, data) == _outcome(_record_path, data)


def _container() -> bytes:
    out = io.BytesIO()
    write_container(out, EVENTS, session_id="s", header={"type": "session", "id": "s"})
    return out.getvalue()


CONTAINER = _container()


@settings(max_examples=150, deadline=None)
@given(st.integers(0, len(CONTAINER) - 1), st.integers(0, 255), st.booleans())
def test_damaged_container_files(pos: int, byte: int, truncate: bool) -> None:
    data = bytearray(CONTAINER)
    if truncate:
        del data[pos:]
    else:
        data[pos] = byte
    try:
        read_container(io.BytesIO(bytes(data)), "damaged.avro")
    except CodecError as exc:
        assert "damaged.avro" in str(exc)


def test_payload_longs_beyond_64_bits_are_refused_naming_the_field() -> None:
    long_max = b"\xfe" + b"\xff" * 8 + b"\x01"
    data = SERDE.encode("s", Event("turn/start", 0, 1, {"turn": 2**63 - 1}))
    assert data.count(long_max) == 1 and SERDE.decode(data)[1].data == {"turn": 2**63 - 1}
    with pytest.raises(CodecError, match=r"dsh\.TurnStart\.turn: varint of 65 bits"):
        SERDE.decode(data.replace(long_max, long_max[:-1] + b"\x03"))
