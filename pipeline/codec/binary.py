"""Avro binary encoding compiled from a schema into straight-line Python (the hot path).

fastavro interprets the schema (a tree of dicts) for every record; for the small records of
the session topic that costs more than the bytes themselves (about 0.25 us per field and
0.5-1 us per union). This module generates, once per schema, one Python function per named
record that reads or writes exactly that record: varints of one byte inlined, unions as
``if`` chains, no validation pass. It covers the whole Avro type system (null, boolean,
int, long, float, double, bytes, string, record, enum, array, map, union, fixed; logical
types are read as their base type). fastavro stays the reference implementation: the tests
check that both agree byte for byte. The helpers the generated code calls (varints, which
refuse a value beyond 64 bits) are in :mod:`pipeline.codec.binary_runtime`. The install
compiles the decoder source of the session-event schema with Cython where it can, and a
schema whose source is exactly that one decodes with it (:mod:`pipeline.codec.binary_native`).

Value conventions (those of fastavro): records are dicts; a union value is ``None`` for
null, a ``(name, value)`` tuple naming the branch, or a value whose Python type picks the
branch (the first in union order that takes it); an optional ``[null, X]`` union takes
``None`` or the plain value only (no tuple: the fast path of every optional field);
decoded unions with more than one record branch give ``(record name, record)``
(fastavro's ``return_record_name=True, return_record_name_override=True``).

Errors: every decoder or encoder failure surfaces as :class:`AvroBinaryError` (a
:class:`CodecError`) from :meth:`CompiledSchema.decode` / :meth:`CompiledSchema.encode`;
the generated code itself raises whatever Python raises and is wrapped in one place.
"""

from __future__ import annotations

import re
import struct
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

from pipeline.codec.binary_native import compiled_decoder
from pipeline.codec.binary_runtime import (
    INT_MAX,
    INT_MIN,
    ZIGZAG,
    Malformed,
    fail,
    not_an_int,
    read_raw_varint,
    write_int,
    write_long,
)
from pipeline.core.errors import CodecError

PRIMITIVES: Final = frozenset(
    {"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
ZERO_SIZE_ITEM_LIMIT: Final = 1_000_000
class AvroBinaryError(CodecError):
    """Bytes that are not a valid encoding of the schema, or a value that does not fit it."""


# A generated decoder: (data, start, len(data)) -> (value, position after it).
Decoder = Callable[[bytes, int, int], tuple[Any, int]]
# A union read with a table of decoders instead of an if chain from this many branches.
_UNION_TABLE_FROM: Final = 4

# The names generated code calls (short: they are in every generated line).
_HELPERS: Final[dict[str, Any]] = {
    "_wlong": write_long, "_wint": write_int, "_rraw": read_raw_varint, "_ZZ": ZIGZAG,
    "_Bad": Malformed, "_fail": fail, "_not_int": not_an_int, "_INT_MIN": INT_MIN,
    "_INT_MAX": INT_MAX,
    "_pack_d": struct.Struct("<d").pack, "_pack_f": struct.Struct("<f").pack,
    "_unpack_d": struct.Struct("<d").unpack_from, "_unpack_f": struct.Struct("<f").unpack_from,
    "_ZERO_LIMIT": ZERO_SIZE_ITEM_LIMIT,
}


def _type_name(schema: Any) -> str:
    """The name a union branch is known by: full name for named types, else the type."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, list):
        return "union"
    kind = str(schema["type"])
    return str(schema["name"]) if kind in ("record", "enum", "fixed") else kind


class RecordBuilder(Protocol):
    """Lets a caller decode chosen records straight into its own shape (no dict between).

    ``tail`` gets a record schema and its fields paired with the local variable holding
    each decoded value, and returns the source lines (indented 4) that end the generated
    decoder with ``return <value>, pos``, or None for the usual dict. ``helpers`` are the
    names those lines use. ``untagged`` names the union fields whose record branches the
    tail takes as plain values, without the ``(name, value)`` tuple.
    """

    helpers: Mapping[str, Any]

    def tail(self, record: Mapping[str, Any], fields: list[tuple[Mapping[str, Any], str]]
             ) -> list[str] | None: ...

    def untagged(self, record: Mapping[str, Any], field: Mapping[str, Any]) -> bool: ...


class _Compiler:
    """Generates the source of the encoder and decoder functions of one schema."""

    def __init__(self, named: Mapping[str, Any], builder: RecordBuilder | None = None) -> None:
        self.named = named
        self.builder = builder
        self.lines: list[str] = []  # encoders
        self.decoder_lines: list[str] = []
        self.tables: list[str] = []  # module-level lines, after every function
        self.consts: dict[str, Any] = {}
        self.done: set[str] = set()
        self.pending: list[Any] = []
        self.counter = 0

    # -- helpers ---------------------------------------------------------------------------
    def var(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def const(self, value: Any) -> str:
        name = f"_C{len(self.consts)}"
        self.consts[name] = value
        return name

    def resolve(self, schema: Any) -> Any:
        if isinstance(schema, str) and schema not in PRIMITIVES:
            if schema not in self.named:
                raise CodecError(f"schema refers to unknown type {schema!r}")
            return self.named[schema]
        if isinstance(schema, Mapping) and schema.get("type") in PRIMITIVES:
            return schema["type"]  # {"type": "long", "logicalType": ...}: the base type
        return schema

    def fname(self, kind: str, record: Mapping[str, Any]) -> str:
        name = str(record["name"])
        if name not in self.done:
            self.done.add(name)
            self.pending.append(record)
        return f"_{kind}_{re.sub(r'[^0-9A-Za-z_]', '_', name)}"

    def emit_all(self, root: Any) -> None:
        root = self.resolve(root)
        if not (isinstance(root, Mapping) and root.get("type") == "record"):
            raise CodecError("only record schemas are compiled")
        self.fname("enc", root)
        while self.pending:
            record = self.pending.pop()
            self.emit_record(record)

    def emit_record(self, record: Mapping[str, Any]) -> None:
        enc, dec = self.fname("enc", record), self.fname("dec", record)
        out = [f"def {enc}(buf, d):"]
        for field in record["fields"]:
            v = self.var("v")
            if "default" in field:
                out.append(f"    {v} = d.get({field['name']!r}, {self.const(field['default'])})")
            else:
                out.append(f"    {v} = d[{field['name']!r}]")
            self.emit_write(out, field["type"], v, "    ")
        out.append("    return None")
        self.lines.extend(out)
        out = [f"def {dec}(data, pos, size):"]
        fields = [(field, self.var("v")) for field in record["fields"]]
        for field, v in fields:
            tag = self.builder is None or not self.builder.untagged(record, field)
            where = f"{record['name']}.{field['name']}"
            self.emit_read(out, field["type"], v, "    ", where, tag)
        tail = self.builder.tail(record, fields) if self.builder is not None else None
        if tail is None:
            items = ", ".join(f"{field['name']!r}: {v}" for field, v in fields)
            tail = [f"    return {{{items}}}, pos"]
        out.extend(tail)
        self.decoder_lines.extend(out)

    # -- writing ---------------------------------------------------------------------------
    def emit_write(self, out: list[str], schema: Any, v: str, ind: str) -> None:
        schema = self.resolve(schema)
        if isinstance(schema, list):
            self.emit_write_union(out, schema, v, ind)
            return
        kind = schema if isinstance(schema, str) else schema["type"]
        if kind == "null":
            out.append(f"{ind}if {v} is not None: raise _Bad('expected null')")
        elif kind == "boolean":
            out.append(f"{ind}buf.append(1 if {v} is True else 0 if {v} is False else "
                       f"_fail('expected a boolean'))")
        elif kind in ("int", "long"):
            out.append(f"{ind}if type({v}) is int and 0 <= {v} < 64: buf.append({v} << 1)")
            out.append(f"{ind}else: {'_wint' if kind == 'int' else '_wlong'}(buf, {v})")
        elif kind in ("float", "double"):
            out.append(f"{ind}buf += {'_pack_d' if kind == 'double' else '_pack_f'}({v})")
        elif kind in ("string", "bytes"):
            b = self.var("b")
            out.append(f"{ind}{b} = {v}.encode()" if kind == "string" else
                       f"{ind}{b} = bytes({v})")
            out.append(f"{ind}if len({b}) < 64: buf.append(len({b}) << 1)")
            out.append(f"{ind}else: _wlong(buf, len({b}))")
            out.append(f"{ind}buf += {b}")
        elif kind == "fixed":
            out.append(f"{ind}if len({v}) != {int(schema['size'])}: "
                       f"raise _Bad('fixed of wrong size')")
            out.append(f"{ind}buf += {v}")
        elif kind == "enum":
            index = self.const({s: i for i, s in enumerate(schema["symbols"])})
            out.append(f"{ind}_wlong(buf, {index}[{v}])")
        elif kind == "record":
            out.append(f"{ind}{self.fname('enc', schema)}(buf, {v})")
        elif kind in ("array", "map"):
            self.emit_write_block(out, schema, v, ind, kind)
        else:
            raise CodecError(f"unsupported Avro type {kind!r}")

    def emit_write_block(self, out: list[str], schema: Mapping[str, Any], v: str, ind: str,
                         kind: str) -> None:
        x = self.var("x")
        out.append(f"{ind}if {v}:")
        out.append(f"{ind}    _wlong(buf, len({v}))")
        if kind == "array":
            out.append(f"{ind}    for {x} in {v}:")
            self.emit_write(out, schema["items"], x, ind + "        ")
        else:
            k = self.var("k")
            out.append(f"{ind}    for {k}, {x} in {v}.items():")
            self.emit_write(out, "string", k, ind + "        ")
            self.emit_write(out, schema["values"], x, ind + "        ")
        out.append(f"{ind}buf.append(0)")

    def emit_write_union(self, out: list[str], branches: list[Any], v: str, ind: str) -> None:
        resolved = [self.resolve(b) for b in branches]
        names = {_type_name(r): i for i, r in enumerate(resolved)}
        null_index = names.get("null")
        others = [i for i in range(len(branches)) if i != null_index]
        kw = "if"
        if null_index is not None:  # the common optional field: no branch search at all
            out.append(f"{ind}if {v} is None: buf.append({null_index * 2})")
            kw = "elif"
        if null_index is not None and len(others) == 1:
            out.append(f"{ind}else:")
            out.append(f"{ind}    buf.append({others[0] * 2})")
            self.emit_write(out, branches[others[0]], v, ind + "    ")
            return
        i = self.var("i")
        if null_index is not None:
            out[-1] = f"{ind}if {v} is None: {i} = {null_index}"
        out.append(f"{ind}{kw} type({v}) is tuple:")
        out.append(f"{ind}    {i} = {self.const(names)}[{v}[0]]; {v} = {v}[1]")
        out.append(f"{ind}else:")
        out.append(f"{ind}    {i} = {self.const(self.union_picker(branches))}({v})")
        for index in range(len(branches)):
            out.append(f"{ind}{'if' if index == 0 else 'elif'} {i} == {index}:")
            out.append(f"{ind}    buf.append({index * 2})")
            self.emit_write(out, branches[index], v, ind + "    ")
        out.append(f"{ind}else: raise _Bad('no union branch fits the value')")

    def union_picker(self, branches: list[Any]) -> Callable[[Any], int]:
        """Branch index from the Python type of a value: the first branch that takes it,
        in union order (as fastavro chooses for unambiguous values)."""
        tests: list[tuple[int, tuple[type, ...], frozenset[str] | None]] = []
        for index, branch in enumerate(branches):
            resolved = self.resolve(branch)
            kind = resolved if isinstance(resolved, str) else resolved["type"]
            symbols = frozenset(resolved["symbols"]) if kind == "enum" else None
            tests.append((index, _PY_TYPES.get(kind, (str,) if kind == "enum" else ()),
                          symbols))

        def pick(value: Any) -> int:
            py = type(value)
            for index, types, symbols in tests:
                if py in types and (symbols is None or value in symbols):
                    return index
            raise Malformed(f"no union branch for a {py.__name__}")

        return pick

    # -- reading ---------------------------------------------------------------------------
    def emit_read_long(self, out: list[str], t: str, ind: str, where: str) -> None:
        """Read a long into ``t``; ``where`` names it in the error of a refused varint."""
        out.append(f"{ind}{t} = data[pos]; pos += 1")
        out.append(f"{ind}if {t} < 128: {t} = _ZZ[{t}]")
        # Two bytes inline (a seq past 63, a string of 64-8191 bytes): no call.
        out.append(f"{ind}elif data[pos] < 128:")
        out.append(f"{ind}    {t} = ({t} & 127) | (data[pos] << 7); pos += 1; "
                   f"{t} = ({t} >> 1) ^ -({t} & 1)")
        out.append(f"{ind}else:")
        out.append(f"{ind}    {t}, pos = _rraw(data, pos - 1, {where!r}); "
                   f"{t} = ({t} >> 1) ^ -({t} & 1)")

    def emit_read(self, out: list[str], schema: Any, t: str, ind: str, where: str,
                  tag: bool = True) -> None:
        """Read a value of ``schema`` into ``t``; ``where`` is the field path errors name."""
        schema = self.resolve(schema)
        if isinstance(schema, list):
            self.emit_read_union(out, schema, t, ind, where, tag)
            return
        kind = schema if isinstance(schema, str) else schema["type"]
        if kind == "null":
            out.append(f"{ind}{t} = None")
        elif kind == "boolean":
            b = self.var("b")
            out.append(f"{ind}{b} = data[pos]; pos += 1")
            out.append(f"{ind}if {b} > 1: raise _Bad('a boolean byte must be 0 or 1')")
            out.append(f"{ind}{t} = {b} == 1")
        elif kind in ("int", "long"):
            self.emit_read_long(out, t, ind, where)
            if kind == "int":  # a varint any 32-bit writer could have written
                out.append(f"{ind}if not _INT_MIN <= {t} <= _INT_MAX: _not_int({t}, {where!r})")
        elif kind in ("float", "double"):
            width = 8 if kind == "double" else 4
            out.append(f"{ind}{t} = {'_unpack_d' if width == 8 else '_unpack_f'}"
                       f"(data, pos)[0]; pos += {width}")
        elif kind in ("string", "bytes", "fixed"):
            self.emit_read_bytes(out, schema, kind, t, ind, where)
        elif kind == "enum":
            n = self.var("n")
            self.emit_read_long(out, n, ind, where)
            symbols = tuple(schema["symbols"])
            out.append(f"{ind}if not 0 <= {n} < {len(symbols)}: "
                       f"raise _Bad('enum index out of range')")
            out.append(f"{ind}{t} = {self.const(symbols)}[{n}]")
        elif kind == "record":
            out.append(f"{ind}{t}, pos = {self.fname('dec', schema)}(data, pos, size)")
        elif kind in ("array", "map"):
            self.emit_read_block(out, schema, kind, t, ind, where)
        else:
            raise CodecError(f"unsupported Avro type {kind!r}")

    def emit_read_bytes(self, out: list[str], schema: Any, kind: str, t: str, ind: str,
                        where: str) -> None:
        n, e = self.var("n"), self.var("e")
        if kind == "fixed":
            out.append(f"{ind}{n} = {int(schema['size'])}")
        else:
            self.emit_read_long(out, n, ind, f"{where} (length)")
            out.append(f"{ind}if {n} < 0: raise _Bad('negative length')")
        out.append(f"{ind}{e} = pos + {n}")
        out.append(f"{ind}if {e} > size: raise _Bad('length runs past the end')")
        decode = ".decode()" if kind == "string" else ""
        out.append(f"{ind}{t} = data[pos:{e}]{decode}; pos = {e}")

    def emit_read_block(self, out: list[str], schema: Mapping[str, Any], kind: str, t: str,
                        ind: str, where: str) -> None:
        c, x, k = self.var("c"), self.var("x"), self.var("k")
        item = schema["items"] if kind == "array" else schema["values"]
        zero_size = kind == "array" and self.may_be_empty(item)
        out.append(f"{ind}{t} = {'[]' if kind == 'array' else '{}'}")
        out.append(f"{ind}while True:")
        self.emit_read_long(out, c, ind + "    ", f"{where} (block count)")
        out.append(f"{ind}    if {c} == 0: break")
        out.append(f"{ind}    if {c} < 0:")
        out.append(f"{ind}        {c} = -{c}")
        self.emit_read_long(out, self.var("skip"), ind + "        ", f"{where} (block size)")
        limit = "_ZERO_LIMIT" if zero_size else "size - pos"
        out.append(f"{ind}    if {c} > {limit}: raise _Bad('block count exceeds the data')")
        out.append(f"{ind}    for _ in range({c}):")
        if kind == "map":
            self.emit_read(out, "string", k, ind + "        ", f"{where}[key]")
        self.emit_read(out, item, x, ind + "        ", f"{where}[]")
        out.append(f"{ind}        {t}.append({x})" if kind == "array" else
                   f"{ind}        {t}[{k}] = {x}")

    def may_be_empty(self, schema: Any, seen: frozenset[str] = frozenset()) -> bool:
        """Whether a value of this type can encode to zero bytes (null, empty record...)."""
        schema = self.resolve(schema)
        if isinstance(schema, list):
            return False  # a union always writes its branch index
        kind = schema if isinstance(schema, str) else schema["type"]
        if kind == "null":
            return True
        if kind == "fixed":
            return int(schema["size"]) == 0
        if kind == "record":
            if schema["name"] in seen:
                return False
            inner = seen | {schema["name"]}
            return all(self.may_be_empty(f["type"], inner) for f in schema["fields"])
        return False

    def emit_read_union(self, out: list[str], branches: list[Any], t: str, ind: str,
                        where: str, tag: bool = True) -> None:
        resolved = [self.resolve(b) for b in branches]
        records = [r for r in resolved if isinstance(r, Mapping) and r.get("type") == "record"]
        tag = tag and len(records) > 1
        # The branch index is compared as written (2 * index): no zigzag decoding.
        n = self.var("n")
        out.append(f"{ind}{n} = data[pos]; pos += 1")
        out.append(f"{ind}if {n} > 127: {n}, pos = _rraw(data, pos - 1, "
                   f"{where + ' (union branch)'!r})")
        if len(records) == len(resolved) >= _UNION_TABLE_FROM:
            self.emit_read_record_union(out, records, n, t, ind, tag)
            return
        for index, branch in enumerate(resolved):
            out.append(f"{ind}{'if' if index == 0 else 'elif'} {n} == {index * 2}:")
            self.emit_read(out, branch, t, ind + "    ", where)
            if tag and branch in records:
                out.append(f"{ind}    {t} = ({str(branch['name'])!r}, {t})")
        out.append(f"{ind}else: raise _Bad('union branch index out of range')")

    def emit_read_record_union(self, out: list[str], records: list[Mapping[str, Any]], n: str,
                               t: str, ind: str, tag: bool) -> None:
        """A union of many records: the decoder from a table indexed by the raw index."""
        table = f"_U{len(self.tables)}"
        decoders = [self.fname("dec", r) for r in records]
        self.tables.append(f"{table} = ({', '.join(f'{d}, None' for d in decoders)})")
        names = self.const(tuple(x for r in records for x in (str(r["name"]), None)))
        out.append(f"{ind}if {n} & 1 or {n} >= {len(records) * 2}: "
                   f"raise _Bad('union branch index out of range')")
        out.append(f"{ind}{t}, pos = {table}[{n}](data, pos, size)")
        if tag:
            out.append(f"{ind}{t} = ({names}[{n}], {t})")


_PY_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "null": (type(None),), "boolean": (bool,), "int": (int,), "long": (int,),
    "float": (float,), "double": (float,), "string": (str,), "bytes": (bytes, bytearray),
    "fixed": (bytes,), "record": (dict,), "map": (dict,), "array": (list,),
}


class CompiledSchema:
    """Encoder and decoder of one record schema (parsed by fastavro, names resolved).

    Decodes with the compiled build of its generated decoder when the install built one for
    exactly this source (:mod:`pipeline.codec.binary_native`), else with the generated
    Python; :func:`use_compiled_decoders` chooses between them for every live instance."""

    def __init__(self, parsed: Mapping[str, Any], builder: RecordBuilder | None = None
                 ) -> None:
        compiler = _Compiler(parsed.get("__named_schemas", {}), builder)
        compiler.emit_all(parsed)
        helpers = builder.helpers if builder is not None else {}
        namespace: dict[str, Any] = {**_HELPERS, **helpers, **compiler.consts}
        self.decoder_source = "\n".join(compiler.decoder_lines + compiler.tables)
        exec("\n".join([*compiler.lines, self.decoder_source]), namespace)  # our own code
        self._encode: Callable[[bytearray, Any], None] = namespace[
            compiler.fname("enc", parsed)]
        root = compiler.fname("dec", parsed)
        self.python_decoder: Decoder = namespace[root]
        self.compiled_decoder: Decoder | None = compiled_decoder(
            self.decoder_source, namespace, root)
        self.decoder = self.python_decoder
        _LIVE.add(self)
        self._choose()

    def _choose(self) -> None:
        compiled = self.compiled_decoder
        self.decoder = compiled if compiled is not None and _CHOICE["compiled"] else (
            self.python_decoder)

    @property
    def compiled_in_use(self) -> bool:
        return self.decoder is not self.python_decoder

    def encode_into(self, buf: bytearray, record: Any) -> None:
        """Append the encoding of ``record``. Raises AvroBinaryError if it does not fit;
        a str that UTF-8 cannot encode raises UnicodeEncodeError (callers may fall back)."""
        try:
            self._encode(buf, record)
        except UnicodeEncodeError:
            raise
        except Malformed as exc:
            raise AvroBinaryError(f"value does not fit the schema: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError,
                OverflowError, struct.error) as exc:
            raise AvroBinaryError(f"value does not fit the schema: {type(exc).__name__}: "
                                  f"{exc}") from None

    def decode(self, data: bytes, start: int = 0) -> Any:
        """The one record encoded in ``data[start:]``; trailing bytes are an error."""
        if type(data) is not bytes:  # the compiled decoder reads bytes only
            data = bytes(data)
        size = len(data)
        try:  # not through decode_at: a call less on the hot path
            record, end = self.decoder(data, start, size)
        except DECODE_ERRORS as exc:
            raise undecodable(exc) from None
        if end != size:
            raise trailing_bytes(size - end)
        return record

    def decode_at(self, data: bytes, start: int) -> tuple[Any, int]:
        """The record encoded at ``data[start:]`` and the position after it, where the
        next record of a sequence (a container file's block) starts."""
        if type(data) is not bytes:
            data = bytes(data)
        try:
            result: tuple[Any, int] = self.decoder(data, start, len(data))
        except DECODE_ERRORS as exc:
            raise undecodable(exc) from None
        return result


_LIVE: Final[weakref.WeakSet[CompiledSchema]] = weakref.WeakSet()
_CHOICE: Final = {"compiled": True}


def use_compiled_decoders(enabled: bool) -> None:
    """Decode with the compiled decoders where the install built them (the default), or
    with the generated Python everywhere (the reference both are tested against), from now
    on and in every live :class:`CompiledSchema`."""
    _CHOICE["compiled"] = enabled
    for schema in list(_LIVE):
        schema._choose()


# What generated decoders raise on bytes that are not an encoding of their schema.
DECODE_ERRORS: Final = (Malformed, IndexError, UnicodeDecodeError, struct.error, RecursionError,
                         MemoryError)


def trailing_bytes(count: int) -> AvroBinaryError:
    return AvroBinaryError(f"{count} trailing bytes after the Avro record")


def undecodable(exc: BaseException) -> AvroBinaryError:
    """The error of a generated decoder's exception (one of DECODE_ERRORS)."""
    if isinstance(exc, Malformed):
        return AvroBinaryError(f"undecodable Avro data: {exc}")
    if isinstance(exc, IndexError):
        return AvroBinaryError("undecodable Avro data: truncated")
    return AvroBinaryError(f"undecodable Avro data: {type(exc).__name__}: {exc}"[:300])
