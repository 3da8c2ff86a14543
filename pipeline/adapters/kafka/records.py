"""Plain record types the Kafka adapters exchange with services.

Services never see aiokafka's types: they hand :class:`OutRecord` values to a producer
adapter and receive :class:`InboxRecord` values from a consumer adapter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

Headers = tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class OutRecord:
    """A record to produce. ``partition`` None means the default (murmur2) partitioner;
    ``value`` None is a tombstone (compaction drops the key)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers = ()
    partition: int | None = None


class ConsumedRecord(Protocol):
    """What readers of consumed records use: an :class:`InboxRecord`, or the Kafka client's
    own record (read as it is, without the copy). A header value may be None (a foreign
    producer's): treat it as an absent header."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes | None]]: ...


@dataclass(frozen=True, slots=True)
class InboxRecord:
    """A consumed record with where it came from (for offsets and dead letters)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers = ()
    timestamp_ms: int = 0


def headers_of(raw: Iterable[tuple[str, bytes | None]] | None) -> Headers:
    """aiokafka gives headers as a sequence of (str, bytes) pairs; normalise None values."""
    if not raw:
        return ()
    return tuple((name, value if value is not None else b"") for name, value in raw)


def header_value(headers: Sequence[tuple[str, bytes]], name: str) -> bytes | None:
    """The last value of header ``name``, or None."""
    found: bytes | None = None
    for key, value in headers:
        if key == name:
            found = value
    return found
