"""Typed payload records written straight from an event's JSON data (the encode hot path).

The generic payload codec (:class:`pipeline.codec.payload.RecordPlan`) builds a record dict
from the data, which the compiled codec then writes: two passes and a dict per record. For
the common case, data whose keys are all modeled, in canonical order, each value of its
field's type, the record has no ``extra`` and no ``keyOrder`` and its bytes follow from the
data alone. This module generates, once per schema, one function per payload record that
writes exactly those bytes from the data, and raises :class:`Unrepresentable` on anything
else (a key it does not model, another order, a value of another type, a nested record that
needs ``extra``): the caller then takes the record path, which decides what to do. So a
direct writer either writes the bytes the record path would write, or writes nothing
useful and says so; the tests check the first part byte for byte.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Mapping
from typing import Any, Final

from pipeline.codec.payload import (
    EXTRA,
    JSON_FIELD,
    KEY_ORDER,
    LAYOUT_CACHE_LIMIT,
    LONG_MAX,
    LONG_MIN,
    RECORD,
    RECORDS,
    SCALAR,
    PlanBuilder,
    RecordPlan,
    Unrepresentable,
    json_text,
)
from pipeline.core.events import JsonValue

DirectWriter = Callable[[bytearray, JsonValue], None]
_MISSING: Final = object()


def write_long(buf: bytearray, n: int) -> None:
    """Append a long; a value outside the Avro long range is Unrepresentable."""
    if 1 << 34 <= n < 1 << 41:
        # Six bytes: the millisecond timestamp of every event (1970-07 to 2039-09), in two
        # halves that fit a machine word (cheaper integer operations than the loop's).
        low, high = (n << 1) & 0xFFFFFFF, n >> 27
        buf += bytes(((low & 0x7F) | 0x80, ((low >> 7) & 0x7F) | 0x80,
                      ((low >> 14) & 0x7F) | 0x80, (low >> 21) | 0x80, (high & 0x7F) | 0x80,
                      high >> 7))
        return
    if 0 <= n < 1 << 20:  # up to three bytes: lengths, counts, token numbers
        z = n << 1
        if z < 0x80:
            buf.append(z)
        elif z < 0x4000:
            buf += bytes(((z & 0x7F) | 0x80, z >> 7))
        else:
            buf += bytes(((z & 0x7F) | 0x80, ((z >> 7) & 0x7F) | 0x80, z >> 14))
        return
    if not LONG_MIN <= n <= LONG_MAX:
        raise Unrepresentable  # the record path carries it in extra, as JSON
    z = (n << 1) ^ (n >> 63)
    while z > 0x7F:
        buf.append((z & 0x7F) | 0x80)
        z >>= 7
    buf.append(z)


Layout = tuple[bool, tuple[str, ...] | None]
"""What a key tuple needs: (in canonical order, the keys ``extra`` holds or None)."""


def _check_layout(known: dict[tuple[str, ...], Layout], plan: RecordPlan,
                  keys: tuple[str, ...]) -> Layout:
    """The layout of data with these keys, all modeled values fitting their fields (the
    generated writer checks each value; a misfit leaves the record to the record path).
    Canonical order: modeled keys in field order, then the extra keys (RecordPlan's rule)."""
    last = -1
    in_order = True
    extra: list[str] = []
    by_key = plan.by_key
    for key in keys:
        field = by_key.get(key)
        if field is None:
            extra.append(key)
            continue
        if extra or field.index < last:
            in_order = False
        last = field.index
    if (extra and not plan.has_extra) or (not in_order and not plan.has_order) or any(
            key not in keys for key in plan.required):
        raise Unrepresentable
    layout = (in_order, tuple(extra) if extra else None)
    if len(known) < LAYOUT_CACHE_LIMIT:
        known[keys] = layout
    return layout


_HELPERS: Final[dict[str, Any]] = {
    "_M": _MISSING, "_Unrep": Unrepresentable, "_wlong": write_long, "_jtext": json_text,
    "_layout": _check_layout, "_pack_d": struct.Struct("<d").pack,
    "_pack_f": struct.Struct("<f").pack,
}
_SCALAR_CHECKS: Final = {"long": "int", "int": "int", "string": "str", "double": "float",
                         "float": "float"}


class _Unsupported(Exception):
    """A record (or one it contains) has a field shape the direct writers do not cover."""


class _Generator:
    def __init__(self, named: Mapping[str, Any], names: frozenset[str]) -> None:
        self.named = named
        self.names = names
        self.plans = PlanBuilder(named)
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {}
        self.supported: dict[str, bool] = {}

    def fname(self, name: str) -> str:
        return f"_w_{re.sub(r'[^0-9A-Za-z_]', '_', name)}"

    def const(self, value: Any) -> str:
        key = f"_K{len(self.consts)}"
        self.consts[key] = value
        return key

    def record(self, name: str) -> bool:
        """Emit the writer of record ``name`` (and those it uses); False if unsupported."""
        if name in self.supported:
            return self.supported[name]
        self.supported[name] = True  # optimistic while in progress: records may recurse
        schema = self.named.get(name)
        try:
            if name not in self.names or not isinstance(schema, Mapping):
                raise _Unsupported
            body = self.body(schema, self.plans.plan(name))
        except _Unsupported:
            self.supported[name] = False
            # A record that refers to this one while in progress calls it: let it decline.
            self.lines.extend([f"def {self.fname(name)}(buf, d):", "    raise _Unrep"])
            return False
        self.lines.append(f"def {self.fname(name)}(buf, d):")
        self.lines.extend(body)
        return True

    def body(self, schema: Mapping[str, Any], plan: RecordPlan) -> list[str]:
        known = self.const({})
        out = ["    if type(d) is not dict: raise _Unrep",
               "    k = tuple(d)",
               f"    lay = {known}.get(k)",
               f"    if lay is None: lay = _layout({known}, {self.const(plan)}, k)"]
        for field in schema["fields"]:
            key = str(field["name"])
            branches = field["type"] if isinstance(field["type"], list) else [field["type"]]
            null = branches.index("null") if "null" in branches else None
            others = [i for i in range(len(branches)) if i != null]
            if key in (EXTRA, KEY_ORDER):
                out.extend(self.write_layout(key, branches, null))
                continue
            if len(others) != 1:
                raise _Unsupported
            value_type, kind = branches[others[0]], plan.by_key[key].kind
            if null is None:
                out.append(f"    v = d[{key!r}]")
                out.extend(self.write(value_type, kind, field, "    "))
            else:
                out.append(f"    v = d.get({key!r}, _M)")
                out.append(f"    if v is _M: buf.append({null * 2})")
                out.append("    else:")
                out.append(f"        buf.append({others[0] * 2})")
                out.extend(self.write(value_type, kind, field, "        "))
        out.append("    return None")
        return out

    @staticmethod
    def write_layout(key: str, branches: list[Any], null: int | None) -> list[str]:
        """``extra`` (the unmodeled keys as JSON text) or ``keyOrder`` (the data's keys when
        not in canonical order), from the layout."""
        other = next((i for i, b in enumerate(branches) if i != null), None)
        if null is None or other is None or len(branches) != 2:
            raise _Unsupported
        if key == EXTRA and branches[other] == "string":
            return [f"    if lay[1] is None: buf.append({null * 2})",
                    "    else:",
                    f"        buf.append({other * 2})",
                    *_string("        ", "_jtext({x: d[x] for x in lay[1]})")]
        if key == KEY_ORDER and branches[other] == {"type": "array", "items": "string"}:
            return [f"    if lay[0]: buf.append({null * 2})",
                    "    else:",
                    f"        buf.append({other * 2})",
                    "        _wlong(buf, len(k))",
                    "        for x in k:",
                    *_string("            ", "x"),
                    "        buf.append(0)"]
        raise _Unsupported

    def write(self, avro_type: Any, kind: int, field: Mapping[str, Any], ind: str
              ) -> list[str]:
        if kind == JSON_FIELD and avro_type == "string":
            return _string(ind, "_jtext(v)")
        if kind == SCALAR and avro_type == "boolean":
            return [f"{ind}if v is True: buf.append(1)",
                    f"{ind}elif v is False: buf.append(0)",
                    f"{ind}else: raise _Unrep"]
        if kind == SCALAR and avro_type in _SCALAR_CHECKS:
            check = f"{ind}if type(v) is not {_SCALAR_CHECKS[avro_type]}: raise _Unrep"
            if avro_type == "string":
                return [check, *_string(ind, "v")]
            if avro_type in ("double", "float"):
                pack = "_pack_d" if avro_type == "double" else "_pack_f"
                return [check, f"{ind}buf += {pack}(v)"]
            return [check, f"{ind}if 0 <= v < 64: buf.append(v << 1)",
                    f"{ind}else: _wlong(buf, v)"]
        if kind == RECORD and isinstance(avro_type, str | Mapping):
            name = _named(avro_type)
            if name is None or not self.record(name):
                raise _Unsupported
            return [f"{ind}{self.fname(name)}(buf, v)"]
        if kind == RECORDS and isinstance(avro_type, Mapping):
            name = _named(avro_type.get("items"))
            if name is None or not self.record(name):
                raise _Unsupported
            return [f"{ind}if type(v) is not list: raise _Unrep",
                    f"{ind}if v:",
                    f"{ind}    _wlong(buf, len(v))",
                    f"{ind}    for x in v: {self.fname(name)}(buf, x)",
                    f"{ind}buf.append(0)"]
        raise _Unsupported


def _string(ind: str, expr: str) -> list[str]:
    return [f"{ind}b = {expr}.encode()",
            f"{ind}if len(b) < 64: buf.append(len(b) << 1)",
            f"{ind}else: _wlong(buf, len(b))",
            f"{ind}buf += b"]


def _named(schema: Any) -> str | None:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, Mapping) and schema.get("type") == "record":
        return str(schema["name"])
    return None


def direct_writers(parsed: Mapping[str, Any], names: frozenset[str]
                   ) -> dict[str, DirectWriter]:
    """Record name -> its direct writer, for every payload record (of ``names``, those that
    follow the payload conventions) whose fields the direct path covers."""
    generator = _Generator(parsed.get("__named_schemas", {}), names)
    for name in sorted(names):
        generator.record(name)
    namespace: dict[str, Any] = {**_HELPERS, **generator.consts}
    exec("\n".join(generator.lines), namespace)  # our own generated code, no input text
    return {name: namespace[generator.fname(name)]
            for name, ok in generator.supported.items() if ok}
