"""Plain record types the Kafka adapters exchange with services.

Services never see aiokafka's types: they hand :class:`OutRecord` values to a producer
adapter and receive :class:`InboxRecord` values from a consumer adapter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

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


# A scan builds one InboxRecord per record: setting its slots directly costs about half of
# its frozen dataclass __init__ (an object.__setattr__ call per field), a tenth of a
# consume + decode. The field order is the dataclass's (a test holds them together).
CLIENT_RECORD_FIELDS: Final = ("topic", "partition", "offset", "key", "value", "headers",
                               "timestamp_ms")
_new_record = object.__new__
(_set_topic, _set_partition, _set_offset, _set_key, _set_value, _set_headers,
 _set_timestamp) = (getattr(InboxRecord, name).__set__ for name in CLIENT_RECORD_FIELDS)


def inbox_record_of(raw: Any) -> InboxRecord:
    """The InboxRecord of a client's ConsumerRecord. Header pairs are taken as they are
    (normalising each value costs a sixth of a scan): a foreign producer's header may have a
    None value, which every reader here treats as an absent header."""
    record: InboxRecord = _new_record(InboxRecord)
    _set_topic(record, raw.topic)
    _set_partition(record, raw.partition)
    _set_offset(record, raw.offset)
    _set_key(record, raw.key)
    _set_value(record, raw.value)
    _set_headers(record, tuple(raw.headers) if raw.headers else ())
    _set_timestamp(record, raw.timestamp)
    return record


def headers_of(raw: Iterable[tuple[str, bytes | None]] | None) -> Headers:
    """aiokafka gives headers as a sequence of (str, bytes) pairs; normalise None values."""
    if not raw:
        return ()
    return tuple((name, value if value is not None else b"") for name, value in raw)


def header_value(headers: Sequence[tuple[str, bytes | None]], name: str) -> bytes | None:
    """The last value of header ``name``, or None (also when that value is None)."""
    found: bytes | None = None
    for key, value in headers:
        if key == name:
            found = value
    return found
