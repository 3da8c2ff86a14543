"""The compiled session-event decoder (pipeline.codec.binary_native): built from exactly the
source the generator writes, used when built, and indistinguishable from the generated Python
on valid and malformed input alike."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from fastavro import parse_schema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsh_dev.synth import synth_session
from pipeline.codec.avro import EventSerde
from pipeline.codec.binary import CompiledSchema, use_compiled_decoders
from pipeline.codec.binary_native import (
    MODULE,
    PYX_FILE,
    compiled_decoder,
    decoder_key,
    is_slot_store,
    native_source,
)
from pipeline.codec.schemas import current_event_schema
from pipeline.core.errors import CodecError
from pipeline.core.events import APPEND, Event, Replace

BUILT = importlib.util.find_spec(MODULE) is not None
needs_build = pytest.mark.skipif(not BUILT, reason="the compiled decoder is not built (no "
                                 "Cython or C compiler at install time)")
SERDE = EventSerde()
EVENTS = [e for seed in range(3) for e in synth_session(seed, 300)] + [
    Event("x/y", 2**40, -(2**62), {"k": [1, None, "é" * 70]}, Replace(3, 2**35), (1, 2**20),
          False, ("seq", "type", "time", "data")),
    Event("y" * 200, 8191, 2**63 - 1, None, APPEND, (), True)]
ENCODED = [SERDE.encode("s" * (i % 130), e) for i, e in enumerate(EVENTS)]


def _source(binary: CompiledSchema) -> str | None:
    decoder = binary.python_decoder
    return native_source(binary.decoder_source, decoder.__globals__, decoder.__name__)


def test_the_committed_cython_source_is_what_the_generator_writes() -> None:
    expected = _source(current_event_schema().binary)
    assert expected is not None
    assert PYX_FILE.read_text(encoding="utf-8") == expected, (
        "run `python -m pipeline.codec.native_pyx` and reinstall (pip install -e .)")


@needs_build
def test_the_session_event_schema_decodes_with_the_compiled_decoder_when_built() -> None:
    binary = current_event_schema().binary
    assert binary.compiled_in_use, "built for another source: reinstall (pip install -e .)"
    assert SERDE.writer is current_event_schema()
    use_compiled_decoders(False)
    try:
        assert not binary.compiled_in_use
    finally:
        use_compiled_decoders(True)
    assert binary.compiled_in_use


def _outcome(data: bytes) -> Any:
    try:
        session_id, event = SERDE.decode(data)
    except CodecError as exc:
        return "error", str(exc)
    return session_id, event, event.key_order


def _both(data: bytes) -> tuple[Any, Any]:
    try:
        compiled = _outcome(data)
        use_compiled_decoders(False)
        return compiled, _outcome(data)
    finally:
        use_compiled_decoders(True)


@needs_build
def test_both_decoders_read_every_event_and_refuse_every_truncation_alike() -> None:
    for event, data in zip(EVENTS, ENCODED, strict=True):
        compiled, python = _both(data)
        assert compiled == python and compiled[1] == event
        assert _outcome(bytearray(data)) == compiled  # any bytes-like value
        for end in range(10, len(data)):
            compiled, python = _both(data[:end])
            assert compiled == python and compiled[0] == "error"


@st.composite
def mutations(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(ENCODED)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(10, len(data) - 1))
        data[at] = draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF, draw(st.integers(0, 255))]))
    return bytes(data)


@needs_build
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_both_decoders_agree_on_mutated_records(data: bytes) -> None:
    compiled, python = _both(data)
    assert compiled == python


def _with_seq_varint(varint: bytes) -> bytes:
    """A record of session "s" whose seq is written as ``varint``."""
    data = SERDE.encode("s", Event("t/x", 0, 1, None))
    assert data[10:13] == b"\x02s\x00"  # after the prefix: "s", then seq 0
    return data[:12] + varint + data[13:]



def test_longs_beyond_64_bits_are_refused_on_both_paths(decoder_path: str) -> None:
    long_max = b"\xfe" + b"\xff" * 8 + b"\x01"
    assert SERDE.decode(_with_seq_varint(long_max))[1].seq == 2**63 - 1
    assert SERDE.decode(_with_seq_varint(b"\xc8\x01"))[1].seq == 100  # two bytes, inline
    assert SERDE.decode(_with_seq_varint(b"\x80\x80\x01"))[1].seq == 2**13  # the helper
    assert SERDE.decode(_with_seq_varint(b"\x80" * 9 + b"\x00"))[1].seq == 0  # 10 bytes
    for varint, why in ((b"\x80" * 9 + b"\x02", "varint of 65 bits"),
                        (b"\xff" * 9 + b"\x7f", "varint of 70 bits"),
                        (b"\x80" * 10 + b"\x00", "varint longer than 10 bytes"),
                        (b"\xff" * 12, "varint longer than 10 bytes")):
        with pytest.raises(CodecError, match=rf"dsh\.SessionEvent\.seq: {why}"):
            SERDE.decode(_with_seq_varint(varint))
    with pytest.raises(CodecError, match="truncated"):
        SERDE.decode(_with_seq_varint(b"\x80" * 4)[:16])  # the varint runs past the end


RECURSIVE: dict[str, Any] = {"type": "record", "name": "Node", "fields": [
    {"name": "value", "type": "long"}, {"name": "next", "type": ["null", "Node"]}]}


def _enum_record(symbols: list[str]) -> CompiledSchema:
    return CompiledSchema(parse_schema({"type": "record", "name": "R", "fields": [
        {"name": "e", "type": {"type": "enum", "name": "E", "symbols": symbols}}]}))


def test_recursive_schemas_are_never_compiled() -> None:
    """Calls between compiled functions escape Python's recursion limit."""
    assert _source(CompiledSchema(parse_schema(RECURSIVE))) is None
    assert _source(_enum_record(["A"])) is not None


def test_the_key_covers_the_constants_the_source_reads() -> None:
    one, other = _enum_record(["A", "B"]), _enum_record(["B", "A"])
    assert one.decoder_source == other.decoder_source
    keys = {decoder_key(s.decoder_source, s.python_decoder.__globals__) for s in (one, other)}
    assert len(keys) == 2


@needs_build
@pytest.mark.parametrize("helper", ["_set0", "_rraw"])
def test_helpers_compiled_in_are_used_only_for_the_helpers_they_replace(helper: str) -> None:
    """The Event's fields are stored through their slots' descriptors and the varint reader
    is C in the compiled build; a namespace whose helper is anything else gets no compiled
    decoder."""
    binary = current_event_schema().binary
    namespace = dict(binary.python_decoder.__globals__)
    root = binary.python_decoder.__name__
    assert is_slot_store(namespace["_set0"]) and not is_slot_store(print)
    assert compiled_decoder(binary.decoder_source, namespace, root) is not None
    namespace[helper] = lambda *args: None
    assert compiled_decoder(binary.decoder_source, namespace, root) is None


def test_branch_indexes_and_boolean_bytes_are_read_alike_on_both_paths(decoder_path: str) -> None:
    """Union branch indexes and boolean bytes (C integers in the compiled build): a
    branch index written in two bytes, one far beyond the union, a boolean byte of 2."""
    data = SERDE.encode("s", Event("t/x", 0, 1, None))
    assert data[10:21] == b"\x02s\x00\x02\x06t/x\x00\x00\x00"  # ..., surfaceOp, sources, ignorable
    event = SERDE.decode(data)[1]
    assert SERDE.decode(data[:18] + b"\x80\x00" + data[19:])[1] == event
    assert SERDE.decode(data[:20] + b"\x02\x01" + data[21:])[1].ignorable is True
    with pytest.raises(CodecError, match="union branch index out of range"):
        SERDE.decode(data[:18] + b"\xff" * 9 + b"\x01" + data[19:])
    with pytest.raises(CodecError, match="a boolean byte must be 0 or 1"):
        SERDE.decode(data[:20] + b"\x02\x02" + data[21:])
