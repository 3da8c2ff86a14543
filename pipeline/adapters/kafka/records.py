"""Plain record types the Kafka adapters exchange with services.

Services never see aiokafka's types: they hand :class:`OutRecord` values to a producer
adapter and receive :class:`InboxRecord` values from a consumer adapter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from aiokafka.record.default_records import DefaultRecordBatchBuilder

from pipeline.core.errors import BrokerError

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


def record_bytes(key: bytes | None, value: bytes | None,
                 headers: Sequence[tuple[str, bytes | None]] = ()) -> int:
    """The size the broker counts for one record alone in its batch (framing included):
    what a topic's ``max.message.bytes`` and a producer's ``max_request_size`` limit."""
    return int(DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, list(headers)))


class RecordTooLargeError(BrokerError):
    """A record above the record limit (``DSH_MAX_RECORD_BYTES``): refused before sending."""


def check_fits(record: OutRecord, limit: int, what: str) -> None:
    """Raise :class:`RecordTooLargeError` naming ``what`` when ``record`` is above ``limit``."""
    size = record_bytes(record.key, record.value, record.headers)
    if size > limit:
        raise RecordTooLargeError(
            f"{what} is {size:,} bytes as a Kafka record, above the record limit of "
            f"{limit:,} bytes (DSH_MAX_RECORD_BYTES); nothing was written")


# An inbox command becomes events that carry its content (the user message and the inbox
# splice, one record each) with a larger envelope: the inbox takes commands this much below
# the record limit, so that the events of any command it took fit.
INBOX_HEADROOM_BYTES = 64 * 1024


def inbox_record_limit(max_record_bytes: int) -> int:
    """The largest inbox record (a command) whose events fit ``max_record_bytes``."""
    return max_record_bytes - INBOX_HEADROOM_BYTES


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
