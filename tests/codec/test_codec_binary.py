"""The compiled Avro binary codec agrees with fastavro, byte for byte, both ways."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.codec.binary import AvroBinaryError, CompiledSchema
from pipeline.codec.schemas import current_event_schema, event_schema_history

ALL_TYPES: dict[str, Any] = {
    "type": "record", "name": "All", "namespace": "t", "fields": [
        {"name": "n", "type": "null"},
        {"name": "b", "type": "boolean"},
        {"name": "i", "type": "int"},
        {"name": "l", "type": "long"},
        {"name": "f", "type": "float"},
        {"name": "d", "type": "double"},
        {"name": "by", "type": "bytes"},
        {"name": "s", "type": "string"},
        {"name": "fx", "type": {"type": "fixed", "name": "F4", "size": 4}},
        {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}},
        {"name": "a", "type": {"type": "array", "items": {"type": "array", "items": "long"}}},
        {"name": "m", "type": {"type": "map", "values": ["null", "string"]}},
        {"name": "u", "type": ["null", "long", "string",
                               {"type": "record", "name": "R1",
                                "fields": [{"name": "x", "type": "long"}]},
                               {"type": "record", "name": "R2",
                                "fields": [{"name": "x", "type": "string"}]},
                               {"type": "enum", "name": "E2", "symbols": ["X", "Y"]}]},
        {"name": "empty", "type": {"type": "array", "items": {
            "type": "record", "name": "Empty", "fields": []}}},
        # Two non-null branches: the nested record travels tagged, which fastavro needs to
        # write tagged unions inside it.
        {"name": "next", "type": ["null", "All", "long"]},
    ]}


def datums(schema: Any, named: Mapping[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of an Avro schema as fastavro takes them (named union branches tagged)."""
    if isinstance(schema, str) and schema in named:
        schema = named[schema]
    if isinstance(schema, list):
        return _union(schema, named, depth)
    kind = schema if isinstance(schema, str) else schema["type"]
    simple: dict[str, st.SearchStrategy[Any]] = {
        "null": st.none(), "boolean": st.booleans(), "int": st.integers(-(2**31), 2**31 - 1),
        "long": st.integers(-(2**63), 2**63 - 1),
        "float": st.floats(width=32, allow_nan=False), "double": st.floats(allow_nan=False),
        "bytes": st.binary(max_size=20), "string": st.text(max_size=20),
    }
    if kind in simple:
        return simple[kind]
    if kind == "fixed":
        return st.binary(min_size=schema["size"], max_size=schema["size"])
    if kind == "enum":
        return st.sampled_from(schema["symbols"])
    if kind == "array":
        return st.lists(datums(schema["items"], named, depth + 1), max_size=3)
    if kind == "map":
        return st.dictionaries(st.text(max_size=5), datums(schema["values"], named, depth + 1),
                               max_size=3)
    return st.fixed_dictionaries({f["name"]: datums(f["type"], named, depth + 1)
                                  for f in schema["fields"]})


def _union(branches: list[Any], named: Mapping[str, Any], depth: int) -> st.SearchStrategy[Any]:
    options = []
    non_null = [b for b in branches if b != "null"]
    for branch in branches:
        if depth > 4 and branch != "null" and "null" in branches:
            continue  # recursive schemas: stop through the null branch
        resolved = named.get(branch, branch) if isinstance(branch, str) else branch
        value = datums(resolved, named, depth + 1)
        if isinstance(resolved, Mapping) and "name" in resolved and len(non_null) > 1:
            value = value.map(lambda v, name=resolved["name"]: (name, v))
        options.append(value)
    return st.one_of(options)


def fastavro_bytes(parsed: Any, datum: Any) -> bytes:
    out = io.BytesIO()
    schemaless_writer(out, parsed, datum)
    return out.getvalue()


def fastavro_read(parsed: Any, data: bytes) -> Any:
    return schemaless_reader(io.BytesIO(data), parsed, None, return_record_name=True,
                             return_record_name_override=True)


# Runs of optional fields (null first, null second), nested and recursive.
OPTIONAL_RUNS: dict[str, Any] = {
    "type": "record", "name": "Runs", "fields": [
        {"name": "a", "type": ["null", "string"]},
        {"name": "b", "type": ["null", "long"]},
        {"name": "c", "type": ["null", {"type": "array", "items": "string"}]},
        {"name": "req", "type": "long"},
        {"name": "d", "type": ["null", "boolean"]},
        {"name": "e", "type": ["string", "null"]},
        {"name": "f", "type": ["null", "Runs"]},
        {"name": "g", "type": ["null", "double"]},
    ]}

SCHEMAS = {"all-types": parse_schema(ALL_TYPES), "optional-runs": parse_schema(OPTIONAL_RUNS),
           "session-event": current_event_schema().parsed,
           **{f"history-v{s.version}": s.parsed for s in event_schema_history()}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_compiled_codec_matches_fastavro(name: str) -> None:
    parsed = SCHEMAS[name]
    compiled = CompiledSchema(parsed)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(datums(parsed, parsed["__named_schemas"]))
    def check(datum: Any) -> None:
        expected = fastavro_bytes(parsed, datum)
        ours = bytearray()
        compiled.encode_into(ours, datum)
        assert bytes(ours) == expected
        assert compiled.decode(expected) == fastavro_read(parsed, expected)

    check()


def test_values_that_do_not_fit_are_codec_errors() -> None:
    compiled = CompiledSchema(parse_schema(ALL_TYPES))
    good = {"n": None, "b": True, "i": 1, "l": 2, "f": 1.5, "d": 2.5, "by": b"x", "s": "s",
            "fx": b"abcd", "e": "A", "a": [[1]], "m": {"k": None}, "u": ("t.R1", {"x": 1}),
            "empty": [{}], "next": None}
    compiled.encode_into(bytearray(), good)
    for key, bad in (("l", 2**63), ("b", 1), ("fx", b"abc"), ("e", "Z"), ("u", ("t.R9", {})),
                     ("u", 1.5), ("s", 5), ("a", [["x"]])):
        with pytest.raises(AvroBinaryError):
            compiled.encode_into(bytearray(), {**good, key: bad})
    with pytest.raises(AvroBinaryError):
        compiled.encode_into(bytearray(), {k: v for k, v in good.items() if k != "s"})


def test_huge_counts_of_empty_items_are_refused_not_looped() -> None:
    compiled = CompiledSchema(parse_schema({
        "type": "record", "name": "Z", "fields": [
            {"name": "a", "type": {"type": "array", "items": "null"}}]}))
    with pytest.raises(AvroBinaryError, match="block count"):
        compiled.decode(b"\xfe\xff\xff\xff\xff\xff\xff\xff\x7f")  # 2**62 nulls
    assert compiled.decode(b"\x06\x00") == {"a": [None, None, None]}


def test_structural_errors_name_what_is_wrong() -> None:
    compiled = CompiledSchema(parse_schema({
        "type": "record", "name": "B", "fields": [
            {"name": "b", "type": "boolean"},
            {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"]}}]}))
    assert compiled.decode(b"\x01\x00") == {"b": True, "e": "A"}
    with pytest.raises(AvroBinaryError, match="boolean byte"):
        compiled.decode(b"\x02\x00")
    with pytest.raises(AvroBinaryError, match="enum index"):
        compiled.decode(b"\x00\x02")
    with pytest.raises(AvroBinaryError, match="truncated"):
        compiled.decode(b"\x00")
    with pytest.raises(AvroBinaryError, match="trailing"):
        compiled.decode(b"\x00\x00\x00")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(2**33, 2**42),
                st.integers(-5, 2**21)))
def test_the_direct_writers_longs_are_avro_longs(n: int) -> None:
    """payload_writer.write_long (six-byte timestamps by their own path) writes what
    fastavro writes, and reads back."""
    from pipeline.codec.payload_writer import write_long
    ours = bytearray()
    write_long(ours, n)
    parsed = parse_schema("long")
    assert bytes(ours) == fastavro_bytes(parsed, n)
    assert schemaless_reader(io.BytesIO(bytes(ours)), parsed, None) == n
    for edge in (0, 63, 64, 2**13 - 1, 2**13, 2**20 - 1, 2**20, 2**34 - 1, 2**34, 2**41 - 1,
                 2**41):
        ours = bytearray()
        write_long(ours, edge)
        assert bytes(ours) == fastavro_bytes(parsed, edge)


def test_runs_of_absent_optional_fields_are_read_and_checked() -> None:
    compiled = CompiledSchema(parse_schema(OPTIONAL_RUNS))
    empty = {"a": None, "b": None, "c": None, "req": 3, "d": None, "e": None, "f": None,
             "g": None}
    data = bytes([0, 0, 0, 6, 0, 2, 0, 0])
    assert compiled.decode(data) == empty
    with pytest.raises(AvroBinaryError, match="truncated"):
        compiled.decode(data[:-1])
    with pytest.raises(AvroBinaryError, match="union branch"):
        compiled.decode(bytes([0, 0, 9, 6, 0, 2, 0, 0]))
    # A non-minimal zero (80 00) is still read as the null branch, as fastavro reads it.
    assert compiled.decode(bytes([0x80, 0, 0, 0, 6, 0, 2, 0, 0])) == empty


TWO_BYTES: dict[str, Any] = {
    "type": "record", "name": "T2", "namespace": "t", "fields": [
        {"name": "l", "type": "long"}, {"name": "s", "type": "string"},
        {"name": "a", "type": {"type": "array", "items": "long"}}]}


def test_two_byte_varints_are_read_as_fastavro_reads_them() -> None:
    """Longs, lengths and block counts of two varint bytes (read inline, without the varint
    helper), next to one- and three-byte ones; a varint cut after its first byte."""
    parsed = parse_schema(TWO_BYTES)
    compiled = CompiledSchema(parsed)
    for n in (-8193, -8192, -4097, -65, -64, 63, 64, 100, 4095, 8191, 8192):
        for length in (63, 64, 200, 8191, 8192):
            record = {"l": n, "s": "x" * length, "a": [n] * (length % 150)}
            data = fastavro_bytes(parsed, record)
            assert compiled.decode(data) == record == fastavro_read(parsed, data)
    data = fastavro_bytes(parsed, {"l": 5, "s": "x" * 100, "a": []})
    with pytest.raises(AvroBinaryError, match="truncated"):
        compiled.decode(data[:2])  # the length's second byte is missing


WIDTHS: dict[str, Any] = {
    "type": "record", "name": "W", "namespace": "t", "fields": [
        {"name": "i", "type": "int"},
        {"name": "l", "type": ["null", "long"]},
        {"name": "a", "type": {"type": "array", "items": "long"}}]}
INT_MAX_VARINT = b"\xfe\xff\xff\xff\x0f"
INT_MIN_VARINT = b"\xff\xff\xff\xff\x0f"
BEYOND_INT_VARINT = b"\x80\x80\x80\x80\x10"  # 2**31
BEYOND_LONG_VARINTS = (b"\x80" * 9 + b"\x02", b"\xff" * 9 + b"\x7f", b"\x80" * 10 + b"\x00")


def test_ints_and_longs_that_fit_their_bits_are_read() -> None:
    compiled = CompiledSchema(parse_schema(WIDTHS))
    long_max, long_min = b"\xfe" + b"\xff" * 8 + b"\x01", b"\xff" * 9 + b"\x01"
    for data in (INT_MAX_VARINT + b"\x02" + long_max + b"\x00",
                 INT_MIN_VARINT + b"\x02" + long_min + b"\x02" + long_max + b"\x00",
                 b"\x80" * 4 + b"\x00" + b"\x00" + b"\x80" * 9 + b"\x00"):  # longest zeros
        assert compiled.decode(data) == fastavro_read(parse_schema(WIDTHS), data)


def test_ints_and_longs_beyond_their_bits_are_refused_naming_the_field() -> None:
    """No Avro writer writes an int beyond 32 bits or a long beyond 64 (issue 3): Python
    would read either as a wider integer, which could never be written back."""
    compiled = CompiledSchema(parse_schema(WIDTHS))
    with pytest.raises(AvroBinaryError, match=r"t\.W\.i: 2147483648 does not fit an Avro int"):
        compiled.decode(BEYOND_INT_VARINT + b"\x00\x00")
    for varint in BEYOND_LONG_VARINTS:
        for data, where in ((b"\x00\x02" + varint + b"\x00", r"t\.W\.l"),
                            (b"\x00\x00\x02" + varint + b"\x00", r"t\.W\.a\[\]"),
                            (b"\x00\x00" + varint + b"\x00", r"t\.W\.a \(block count\)"),
                            (b"\x00" + varint + b"\x00", r"t\.W\.l \(union branch\)")):
            with pytest.raises(AvroBinaryError, match=rf"{where}: varint (of|longer)"):
                compiled.decode(data)


def test_ints_beyond_32_bits_are_not_written() -> None:
    compiled = CompiledSchema(parse_schema(WIDTHS))
    for value in (-(2**31), 2**31 - 1):
        ours = bytearray()
        compiled.encode_into(ours, {"i": value, "l": None, "a": []})
        assert bytes(ours) == fastavro_bytes(parse_schema(WIDTHS), {"i": value, "l": None,
                                                                     "a": []})
    for value in (2**31, -(2**31) - 1):
        with pytest.raises(AvroBinaryError, match="does not fit an Avro int"):
            compiled.encode_into(bytearray(), {"i": value, "l": None, "a": []})
