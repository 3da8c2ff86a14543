"""Random and mutated bytes never crash the decoders: always a CodecError, never another."""

from __future__ import annotations

import io
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_paths import SHARED_DIR

from pipeline.codec.avro import EventSerde
from pipeline.codec.container import read_container, write_container
from pipeline.codec.schemas import current_event_schema
from pipeline.core.errors import CodecError
from pipeline.core.events import Event, event_from_json

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
        action = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if action == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif action == "cut":
            del data[pos:]
        elif action == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif data:
            del data[pos]
    return bytes(data)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_encodings(data: bytes) -> None:
    _decode_or_codec_error(data)


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
