"""Small helpers shared by the validators: raising a rule's error, reading typed fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, NoReturn

from pipeline.core.errors import EventError
from pipeline.core.events import Event

Mode = Literal["strict", "ingest"]
MODES: Final = ("strict", "ingest")


def fail(event: Event, detail: str, rule: str) -> NoReturn:
    """Refuse ``event``: the error names its seq, its type and the rule broken."""
    raise EventError(detail, seq=event.seq, type=event.type, rule=rule)


def is_int(value: object) -> bool:
    """A JSON integer (bool is an int subclass in Python, but not a JSON number)."""
    return type(value) is int


def need_int(event: Event, data: Mapping[str, Any], key: str, rule: str) -> None:
    value = data.get(key)
    if type(value) is not int or value < 0:
        fail(event, f"data.{key} must be a non-negative integer", rule)


def need_str(event: Event, obj: Mapping[str, Any], key: str, where: str, rule: str) -> None:
    if not isinstance(obj.get(key), str):
        fail(event, f"{where}.{key} must be a string", rule)
