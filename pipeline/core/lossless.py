"""Lossless JSON: the only values an event's data may hold.

Plain objects with string keys, arrays, strings, finite numbers other than negative zero,
booleans and null. Anything else would not survive a JSON or Avro round trip unchanged.

Lone UTF-16 surrogates (``"\\ud83d"``) are a special case: JSON can carry them as escapes and
JavaScript (dsh) can produce them (a string sliced inside a surrogate pair), but no UTF-8
encoder can write them. Strict validation (what the driver writes) refuses them; ingest
accepts them so real logs still read, and :func:`dumps_json_safe` escapes them on output.

Python's :mod:`json` parses ``NaN``/``Infinity`` and ``-0.0`` silently (and ``-0`` as int 0,
losing the sign), so file readers must parse with :func:`loads_lossless`, which refuses them at
parse time; :func:`find_lossless_violation` checks values built in memory.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from math import copysign, isfinite
from typing import Any, Final

from pipeline.core.events import JsonValue, dumps_json

_LONE_SURROGATE: Final = re.compile("[\ud800-\udfff]")


class LosslessJsonError(ValueError):
    """Raised by :func:`loads_lossless` for a value JSON cannot carry losslessly."""


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise LosslessJsonError(f"number {text} is not finite in a double")
    if value == 0.0 and text.lstrip().startswith("-"):
        raise LosslessJsonError(f"negative zero ({text}) is not lossless JSON")
    return value


def _parse_int(text: str) -> int:
    if text.startswith("-") and text.strip("-0") == "":
        raise LosslessJsonError(f"negative zero ({text}) is not lossless JSON")
    return int(text)


def _parse_constant(name: str) -> Any:
    raise LosslessJsonError(f"{name} is not lossless JSON")


_DECODER: Final = json.JSONDecoder(
    parse_float=_parse_float, parse_int=_parse_int, parse_constant=_parse_constant
)
# The number hooks above run in Python for every number; most lines have nothing they could
# catch, so those are parsed by the C scanner (only NaN/Infinity get a hook there, which costs
# nothing). A line goes the exact way when it holds anything that might be a negative zero
# ("-0" anywhere), an exponent of magnitude 100 or more (overflow to infinity, or underflow to
# -0.0), or 20 digits in a row (with an exponent under 100, fewer cannot overflow); false alarms
# (e.g. inside strings) only cost the slower parse.
_FAST_DECODER: Final = json.JSONDecoder(parse_constant=_parse_constant)
_BIG_EXPONENT: Final = re.compile(r"[eE][+-]?0*[1-9][0-9][0-9]")
_LONG_DIGITS: Final = re.compile(r"[0-9]{20}")  # 20+ integer digits: may overflow


def _may_hold_a_lossy_number(text: str) -> bool:
    return ("-0" in text or _BIG_EXPONENT.search(text) is not None
            or _LONG_DIGITS.search(text) is not None)


def loads_lossless(text: str) -> JsonValue:
    """Parse one JSON document, refusing NaN, infinities and negative zero.

    Raises :class:`LosslessJsonError` for those, :class:`json.JSONDecodeError` for bad syntax
    and :class:`RecursionError` for absurd nesting (callers translate all three).
    """
    if not _may_hold_a_lossy_number(text):
        return _FAST_DECODER.decode(text)
    return _DECODER.decode(text)


def has_lone_surrogate(text: str) -> bool:
    return _LONE_SURROGATE.search(text) is not None


def dumps_json_safe(value: JsonValue) -> str:
    """Compact JSON like :func:`dumps_json`, but ASCII-escaped if it holds a lone surrogate,
    so that the text can always be written as UTF-8."""
    text = dumps_json(value)
    if has_lone_surrogate(text):
        return json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text


def find_lossless_violation(value: JsonValue, *,
                            allow_lone_surrogates: bool = False) -> str | None:
    """The first reason ``value`` is not lossless JSON, with its path; None when it is.

    A fast pass checks without building paths (this runs on every appended event); only a
    value that fails is walked again to name the place. Both walks are iterative (an
    explicit stack), so deep nesting cannot overflow the interpreter stack.
    """
    if _is_lossless(value, allow_lone_surrogates):
        return None
    return _locate_violation(value, allow_lone_surrogates)


def _is_lossless(value: JsonValue, allow_lone_surrogates: bool) -> bool:
    # Runs on every appended event. Leaves (most of any event's data) are checked where they
    # are met, in one type test, not by a call per leaf (which would double the cost); only
    # containers go on the stack. An object's keys are checked first, then its values are
    # items like an array's.
    if type(value) is not dict and type(value) is not list:
        return _leaf_is_lossless(value, allow_lone_surrogates)
    stack = [value]
    pop, push = stack.pop, stack.append
    search = None if allow_lone_surrogates else _LONE_SURROGATE.search
    while stack:
        item = pop()
        children: Iterable[JsonValue] = item
        if type(item) is dict:
            for key in item:
                if type(key) is not str:
                    return False
            children = item.values()
        for child in children:
            kind = type(child)
            if kind is str:
                if search is not None and not child.isascii() and search(child) is not None:
                    return False
            elif kind is dict or kind is list:
                push(child)
            elif kind is float:
                if not isfinite(child) or (child == 0.0 and copysign(1.0, child) < 0):
                    return False
            elif not (kind is int or kind is bool or child is None):
                return False
    return True


def _leaf_is_lossless(value: JsonValue, allow_lone_surrogates: bool) -> bool:
    kind = type(value)
    if kind is str:
        return allow_lone_surrogates or value.isascii() or _LONE_SURROGATE.search(value) is None
    if kind is float:
        return isfinite(value) and not (value == 0.0 and copysign(1.0, value) < 0)
    return value is None or kind is bool or kind is int


def _locate_violation(value: JsonValue, allow_lone_surrogates: bool) -> str | None:
    stack: list[tuple[str, Any]] = [("$", value)]
    while stack:
        path, item = stack.pop()
        kind = type(item)
        if kind is str:
            if not allow_lone_surrogates and _LONE_SURROGATE.search(item) is not None:
                return f"{path}: string holds a lone UTF-16 surrogate"
        elif kind is dict:
            for key, child in item.items():
                if type(key) is not str:
                    return f"{path}: object key {key!r} is not a string"
                stack.append((f"{path}.{key}", child))
        elif kind is list:
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
        elif kind is float:
            if not math.isfinite(item):
                return f"{path}: {item} is not a finite number"
            if item == 0.0 and math.copysign(1.0, item) < 0:
                return f"{path}: negative zero is not lossless JSON"
        elif item is None or kind is bool or kind is int:
            continue
        else:
            return f"{path}: {kind.__name__} is not a JSON value"
    return None
