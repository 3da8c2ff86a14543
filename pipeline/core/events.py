"""The event envelope of dsh session format 0.

An :class:`Event` is one line of a session log and one record of the session topic. It is
frozen; its ``data`` is plain JSON (dicts, lists, str, int, float, bool, None) that no code
may mutate after the event is built: folds and views share it instead of copying.

Absent optional envelope fields are ``None`` here and are left out of the JSON; ``null`` can
only be a value inside ``data``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias, TypeGuard

from pipeline.core.errors import EventError

__all__ = [
    "APPEND",
    "CANONICAL_ORDER",
    "ENVELOPE_KEYS",
    "SURFACE_TYPES",
    "Event",
    "JsonValue",
    "Replace",
    "SurfaceOp",
    "dumps_json",
    "event_from_json",
    "key_order_of",
    "surface_op_to_json",
]

JsonValue: TypeAlias = Any
"""Plain JSON: dict[str, JsonValue] | list[JsonValue] | str | int | float | bool | None."""

ENVELOPE_KEYS: Final = frozenset(
    {"type", "seq", "time", "data", "surfaceOp", "sourceEventSeqs", "ignorable"}
)
SURFACE_TYPES: Final = frozenset({"user/message", "assistant/message", "tool/result"})
CANONICAL_ORDER: Final = ("type", "seq", "time", "data", "surfaceOp", "sourceEventSeqs",
                          "ignorable")


@dataclass(frozen=True, slots=True)
class Replace:
    """``surfaceOp: {"op":"replace","start":S,"end":E}``: S and E are seqs on the surface."""

    start: int
    end: int


SurfaceOp: TypeAlias = Literal["append"] | Replace
APPEND: Final = "append"


@dataclass(frozen=True, slots=True, init=False)
class Event:
    """One session event. ``ignorable`` keeps absent (None) apart from an explicit value."""

    type: str
    seq: int
    time: int
    data: JsonValue
    surface_op: SurfaceOp | None = None
    source_event_seqs: tuple[int, ...] | None = None
    ignorable: bool | None = None
    # The envelope keys' order in the line this event was read from, kept only when it
    # differs from CANONICAL_ORDER (dsh writes `sourceEventSeqs` before `surfaceOp` in some
    # lines), so that export gives back the same bytes. Not part of the event's identity.
    key_order: tuple[str, ...] | None = field(default=None, compare=False)

    def __init__(self, type: str, seq: int, time: int, data: JsonValue,
                 surface_op: SurfaceOp | None = None,
                 source_event_seqs: tuple[int, ...] | None = None,
                 ignorable: bool | None = None,
                 key_order: tuple[str, ...] | None = None) -> None:
        # What the generated __init__ of a frozen dataclass does, at half the cost: it sets
        # each slot through object.__setattr__, this through the slot's own descriptor
        # (events are built by the hundred thousand: every chunk of every stream is one).
        _SET_TYPE(self, type)
        _SET_SEQ(self, seq)
        _SET_TIME(self, time)
        _SET_DATA(self, data)
        _SET_SURFACE_OP(self, surface_op)
        _SET_SOURCES(self, source_event_seqs)
        _SET_IGNORABLE(self, ignorable)
        _SET_KEY_ORDER(self, key_order)

    def to_json(self) -> dict[str, JsonValue]:
        """The event as the JSON object of a log line (envelope keys in their read order)."""
        out = self._canonical_json()
        if self.key_order is None:
            return out
        ordered = {key: out[key] for key in self.key_order if key in out}
        ordered.update(out)  # keys the order does not name keep their canonical place last
        return ordered

    def _canonical_json(self) -> dict[str, JsonValue]:
        out: dict[str, JsonValue] = {
            "type": self.type, "seq": self.seq, "time": self.time, "data": self.data,
        }
        if self.surface_op is not None:
            out["surfaceOp"] = surface_op_to_json(self.surface_op)
        if self.source_event_seqs is not None:
            out["sourceEventSeqs"] = list(self.source_event_seqs)
        if self.ignorable is not None:
            out["ignorable"] = self.ignorable
        return out

    def to_line(self) -> str:
        """One JSONL line (no newline), compact, UTF-8 kept as is."""
        return dumps_json(self.to_json())


_SLOT_SETTERS: Final[dict[str, Any]] = {
    name: vars(Event)[name].__set__ for name in Event.__slots__}
_SET_TYPE: Final = _SLOT_SETTERS["type"]
_SET_SEQ: Final = _SLOT_SETTERS["seq"]
_SET_TIME: Final = _SLOT_SETTERS["time"]
_SET_DATA: Final = _SLOT_SETTERS["data"]
_SET_SURFACE_OP: Final = _SLOT_SETTERS["surface_op"]
_SET_SOURCES: Final = _SLOT_SETTERS["source_event_seqs"]
_SET_IGNORABLE: Final = _SLOT_SETTERS["ignorable"]
_SET_KEY_ORDER: Final = _SLOT_SETTERS["key_order"]


def dumps_json(value: JsonValue) -> str:
    """Compact JSON as dsh writes it: no spaces, non-ASCII kept, NaN refused."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def surface_op_to_json(op: SurfaceOp) -> JsonValue:
    if isinstance(op, Replace):
        return {"op": "replace", "start": op.start, "end": op.end}
    return APPEND


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_surface_op(raw: JsonValue, seq: int | None, type_: str) -> SurfaceOp:
    if raw == APPEND:
        return APPEND
    if isinstance(raw, Mapping) and raw.get("op") == "replace" and set(raw) == {
        "op", "start", "end"
    } and _is_int(raw["start"]) and _is_int(raw["end"]):
        return Replace(int(raw["start"]), int(raw["end"]))
    raise EventError(f"surfaceOp must be \"append\" or {{op:\"replace\",start,end}}, got "
                     f"{dumps_json(raw)[:80]}", seq=seq, type=type_, rule="surface-op-shape")


def event_from_json(obj: JsonValue) -> Event:
    """Build an Event from a decoded JSON object, checking only the envelope's shape.

    The rules of the model (seq contiguity, lossless data, surface rules, message shapes)
    are checked by :mod:`pipeline.core.validation`.
    """
    if not isinstance(obj, Mapping):
        raise EventError("an event must be a JSON object", rule="envelope-object")
    seq = obj.get("seq")
    type_ = obj.get("type")
    seq_for_msg = seq if _is_int(seq) else None
    if not isinstance(type_, str) or not type_:
        raise EventError("missing or non-string 'type'", seq=seq_for_msg, rule="envelope-type")
    extra = set(obj) - ENVELOPE_KEYS
    if extra:
        raise EventError(f"unknown envelope keys {sorted(extra)}", seq=seq_for_msg, type=type_,
                         rule="envelope-keys")
    if not _is_int(seq) or seq < 0:
        raise EventError("'seq' must be a non-negative integer", type=type_, rule="envelope-seq")
    time_ = obj.get("time")
    if not _is_int(time_):
        raise EventError("'time' must be an integer (epoch ms)", seq=seq, type=type_,
                         rule="envelope-time")
    if "data" not in obj:
        raise EventError("missing 'data'", seq=seq, type=type_, rule="envelope-data")
    surface_op = None
    if "surfaceOp" in obj:
        surface_op = _parse_surface_op(obj["surfaceOp"], seq, type_)
    sources = None
    if "sourceEventSeqs" in obj:
        raw = obj["sourceEventSeqs"]
        if not isinstance(raw, list) or not all(_is_int(s) for s in raw):
            raise EventError("'sourceEventSeqs' must be a list of integers", seq=seq,
                             type=type_, rule="source-seqs-shape")
        sources = tuple(raw)
    ignorable = None
    if "ignorable" in obj:
        if not isinstance(obj["ignorable"], bool):
            raise EventError("'ignorable' must be a boolean", seq=seq, type=type_,
                             rule="envelope-ignorable")
        ignorable = obj["ignorable"]
    return Event(type_, seq, time_, obj["data"], surface_op, sources, ignorable,
                 _key_order(obj))


def key_order_of(keys: tuple[str, ...]) -> tuple[str, ...] | None:
    """``keys`` when they are not in canonical order (what :attr:`Event.key_order` keeps)."""
    canonical = tuple(k for k in CANONICAL_ORDER if k in keys)
    return None if keys == canonical else keys


def _key_order(obj: Mapping[str, JsonValue]) -> tuple[str, ...] | None:
    return key_order_of(tuple(obj))
