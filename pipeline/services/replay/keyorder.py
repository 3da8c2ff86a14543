"""Envelope key order: kept so that export(import(x)) == x byte for byte.

dsh does not write the optional envelope keys in one fixed order (its ``assistant/message``
lines put ``sourceEventSeqs`` before ``surfaceOp``, crash-repair closers the other way round),
and :class:`~pipeline.core.events.Event` (like the Avro record) keeps values, not key order.
So the importer notes the order of a line whose envelope keys are not in the canonical order
(``Event.to_json``'s) and sends it as the ``dsh.key-order`` record header (comma-separated
keys); the exporter writes such an event's line in that order.

Only plain ``.jsonl`` files are inspected (a ``.zstd`` file's events are exported in the
canonical order); lines that cannot matter (no optional envelope key) are not parsed twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Final

from pipeline.core.events import dumps_json
from pipeline.core.lossless import dumps_json_safe, has_lone_surrogate

KEY_ORDER_HEADER: Final = "dsh.key-order"
_OPTIONAL: Final = ("surfaceOp", "sourceEventSeqs", "ignorable")


def file_key_orders(path: str | os.PathLike[str]) -> dict[int, tuple[str, ...]]:
    """seq -> envelope key order, for the events of a plain file whose order is not canonical."""
    name = os.fspath(path)
    if not name.endswith(".jsonl"):
        return {}
    orders: dict[int, tuple[str, ...]] = {}
    with open(name, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not any(f'"{key}"' in line for key in _OPTIONAL):
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # a torn or bad line: the reader reports it
            if isinstance(obj, dict) and isinstance(obj.get("seq"), int):
                keys = tuple(obj)
                if keys != tuple(canonical_order(keys)):
                    orders[obj["seq"]] = keys
    return orders


def canonical_order(keys: Iterable[str]) -> list[str]:
    """The order ``Event.to_json`` writes these keys in."""
    order = ("type", "seq", "time", "data", *_OPTIONAL)
    present = set(keys)
    return [k for k in order if k in present]


def parse_key_order(value: bytes | None) -> tuple[str, ...] | None:
    if not value:
        return None
    return tuple(value.decode("ascii", "replace").split(","))


def reorder_lines(lines: Iterable[str], orders: Mapping[int, tuple[str, ...]]) -> Iterator[str]:
    """File lines with the events named in ``orders`` rewritten in their recorded key order."""
    if not orders:
        yield from lines
        return
    for line in lines:
        if not any(f'"{key}"' in line for key in _OPTIONAL):
            yield line
            continue
        obj = json.loads(line)
        seq = obj.get("seq") if isinstance(obj, dict) else None
        order = orders.get(seq) if isinstance(seq, int) else None
        if order is None or set(order) != set(obj):
            yield line
            continue
        text = dumps_json({key: obj[key] for key in order})
        yield dumps_json_safe({key: obj[key] for key in order}) if has_lone_surrogate(text) \
            else text
