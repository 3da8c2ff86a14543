"""Avro schema compatibility, offline: can a reader schema read what writer schemas wrote?

This is the check a schema registry runs before it accepts a new version (``BACKWARD``: the
new schema reads data of the latest version; ``BACKWARD_TRANSITIVE``: of every version), by
the resolution rules of the Avro specification ("Schema Resolution"):

- primitives match when equal or when the writer's promotes to the reader's (int to long,
  float or double; long to float or double; float to double; string and bytes both ways);
- records match by full name (or a reader alias); each reader field takes the writer field
  of its name (or one of its aliases) and must read it, or must have a default; writer
  fields the reader lacks are skipped;
- enums match by name, and every writer symbol must be a reader symbol unless the reader
  has a default symbol; fixed types match by name and size;
- arrays by items, maps by values;
- a writer union: every branch must be readable; a reader union: some branch must read the
  writer (the first match is the one used).

Each problem names the path where it is (``SessionEvent.payload[TurnEnd].reason``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

PROMOTIONS: Final = {("int", "long"), ("int", "float"), ("int", "double"), ("long", "float"),
                     ("long", "double"), ("float", "double"), ("string", "bytes"),
                     ("bytes", "string")}
PRIMITIVES: Final = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
NAMED: Final = {"record", "error", "enum", "fixed"}
COMPLEX: Final = NAMED | {"array", "map"}


class _Names:
    """Named types of one schema by full name, so references can be followed."""

    def __init__(self, schema: Any) -> None:
        self.types: dict[str, Mapping[str, Any]] = {}
        self._collect(schema, "")

    def _collect(self, schema: Any, namespace: str) -> None:
        if isinstance(schema, list):
            for branch in schema:
                self._collect(branch, namespace)
            return
        if not isinstance(schema, Mapping):
            return
        kind = schema.get("type")
        if kind in NAMED:
            full = full_name(schema, namespace)
            self.types[full] = schema
            namespace = full.rpartition(".")[0]
        if kind in ("record", "error"):
            for field in schema.get("fields", ()):
                self._collect(field.get("type"), namespace)
        elif kind == "array":
            self._collect(schema.get("items"), namespace)
        elif kind == "map":
            self._collect(schema.get("values"), namespace)
        elif isinstance(kind, (Mapping, list)):
            self._collect(kind, namespace)

    def resolve(self, schema: Any, namespace: str) -> tuple[Any, str]:
        """The schema itself (a reference followed, ``{"type": "long", ...}`` as ``long``),
        and the namespace names inside it are relative to."""
        if isinstance(schema, Mapping):
            kind = schema.get("type")
            if isinstance(kind, (Mapping, list)) or (
                    isinstance(kind, str) and kind not in PRIMITIVES | COMPLEX):
                return self.resolve(kind, namespace)
            if kind in PRIMITIVES:
                return kind, namespace
            if kind in NAMED:
                return schema, full_name(schema, namespace).rpartition(".")[0]
            return schema, namespace
        if isinstance(schema, str) and schema not in PRIMITIVES:
            full = schema if "." in schema or not namespace else f"{namespace}.{schema}"
            named = self.types.get(full) or self.types.get(schema)
            if named is None:
                raise ValueError(f"unknown type name {schema!r}")
            return named, full_name(named, namespace).rpartition(".")[0]
        return schema, namespace


def full_name(schema: Mapping[str, Any], namespace: str = "") -> str:
    name = str(schema.get("name", ""))
    if "." in name:
        return name
    space = schema.get("namespace", namespace) or ""
    return f"{space}.{name}" if space else name


def _short(name: str) -> str:
    return name.rpartition(".")[2]


def _kind(schema: Any) -> str:
    if isinstance(schema, list):
        return "union"
    if isinstance(schema, Mapping):
        return str(schema.get("type"))
    return str(schema)


class _Checker:
    def __init__(self, reader: Any, writer: Any) -> None:
        self.reader_names = _Names(reader)
        self.writer_names = _Names(writer)
        self.problems: list[str] = []
        self._seen: set[tuple[int, int]] = set()  # recursive types: each pair once

    def check(self, reader: Any, writer: Any, path: str, rns: str = "", wns: str = "") -> bool:
        reader, rns = self.reader_names.resolve(reader, rns)
        writer, wns = self.writer_names.resolve(writer, wns)
        if isinstance(writer, list):
            return all([self.check(reader, branch, f"{path}[{self._label(branch)}]", rns, wns)
                        for branch in writer])
        if isinstance(reader, list):
            if any(self._quiet(branch, writer, rns, wns) for branch in reader):
                return True
            return self._fail(path, f"no branch of the reader's union reads the writer's "
                                    f"{self._label(writer)}")
        rkind, wkind = _kind(reader), _kind(writer)
        if rkind in PRIMITIVES or wkind in PRIMITIVES:
            if rkind == wkind or (wkind, rkind) in PROMOTIONS:
                return True
            return self._fail(path, f"the writer's {wkind} cannot be read as {rkind}")
        if rkind != wkind and not {rkind, wkind} <= {"record", "error"}:
            return self._fail(path, f"the writer's {wkind} cannot be read as {rkind}")
        key = (id(reader), id(writer))
        if key in self._seen:
            return True
        self._seen.add(key)
        if rkind in NAMED and not self._same_name(reader, writer, rns, wns):
            return self._fail(path, f"the writer's {full_name(writer, wns)} cannot be read as "
                                    f"{full_name(reader, rns)} (names differ)")
        return bool(getattr(self, f"_{'record' if rkind == 'error' else rkind}")(
            reader, writer, path, rns, wns))

    def _quiet(self, reader: Any, writer: Any, rns: str, wns: str) -> bool:
        saved, self.problems = self.problems, []
        try:
            return self.check(reader, writer, "", rns, wns)
        finally:
            self.problems = saved

    def _fail(self, path: str, message: str) -> bool:
        self.problems.append(f"{path or '(root)'}: {message}")
        return False

    def _label(self, schema: Any) -> str:
        if isinstance(schema, Mapping) and "name" in schema:
            return _short(str(schema["name"]))
        return _kind(schema) if not isinstance(schema, str) else _short(schema)

    @staticmethod
    def _same_name(reader: Mapping[str, Any], writer: Mapping[str, Any], rns: str,
                   wns: str) -> bool:
        wanted = full_name(writer, wns)
        aliases = {a if "." in a else (f"{rns}.{a}" if rns else a)
                   for a in reader.get("aliases", ())}
        return wanted == full_name(reader, rns) or wanted in aliases

    def _record(self, reader: Mapping[str, Any], writer: Mapping[str, Any], path: str,
                rns: str, wns: str) -> bool:
        written = {f["name"]: f for f in writer.get("fields", ())}
        ok = True
        for field in reader.get("fields", ()):
            names = [field["name"], *field.get("aliases", ())]
            source = next((written[n] for n in names if n in written), None)
            where = f"{path}.{field['name']}" if path else field["name"]
            if source is not None:
                ok = self.check(field["type"], source["type"], where, rns, wns) and ok
            elif "default" not in field:
                ok = self._fail(where, "a new field without a default (data written before "
                                       "it has no value for it)")
        return ok

    def _enum(self, reader: Mapping[str, Any], writer: Mapping[str, Any], path: str,
              rns: str, wns: str) -> bool:
        missing = [s for s in writer.get("symbols", ()) if s not in reader.get("symbols", ())]
        if missing and "default" not in reader:
            return self._fail(path, f"enum symbols {missing} were removed (and the reader "
                                    "has no default symbol)")
        return True

    def _fixed(self, reader: Mapping[str, Any], writer: Mapping[str, Any], path: str,
               rns: str, wns: str) -> bool:
        if reader.get("size") != writer.get("size"):
            return self._fail(path, f"fixed size {writer.get('size')} cannot be read as "
                                    f"{reader.get('size')}")
        return True

    def _array(self, reader: Mapping[str, Any], writer: Mapping[str, Any], path: str,
               rns: str, wns: str) -> bool:
        return self.check(reader["items"], writer["items"], f"{path}[]", rns, wns)

    def _map(self, reader: Mapping[str, Any], writer: Mapping[str, Any], path: str,
             rns: str, wns: str) -> bool:
        return self.check(reader["values"], writer["values"], f"{path}{{}}", rns, wns)


def read_problems(reader: Any, writer: Any) -> list[str]:
    """Why ``reader`` cannot read data written with ``writer`` ([] when it can)."""
    checker = _Checker(reader, writer)
    root = _short(full_name(reader)) if isinstance(reader, Mapping) and "name" in reader else ""
    try:
        checker.check(reader, writer, root)
    except (ValueError, KeyError, TypeError) as exc:
        return [f"not a valid schema: {exc}"]
    return checker.problems


def backward_transitive(reader: Any, history: Iterable[tuple[str, Any]]
                        ) -> dict[str, list[str]]:
    """The problems of ``reader`` against each ``(label, writer schema)`` of the history."""
    return {label: read_problems(reader, writer) for label, writer in history}
