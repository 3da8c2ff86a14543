"""Kafka record key and headers of a session event (DESIGN.md section 2).

- key: the session id, UTF-8 (so a session's events share a partition, in order);
- headers: ``dsh.type`` (event type), ``dsh.seq`` (decimal ASCII), ``dsh.schema`` (the
  value's framing, optional) and ``traceparent`` (W3C trace context) when known.

Consumers read type and seq from the headers without decoding the value, e.g. to skip the
many ``assistant/chunk`` records or to drop duplicates before paying for Avro.

The processors' output records (``fleet``, ``usage``, ``derived-messages``) carry
``dsh.source.partition`` and ``dsh.source.offset``: the session-topic position of the last
event folded into the value (:func:`source_headers`). A reader that starts from an output
follows the session's events from the offset after it, so nothing is seen twice or missed.

A session's writer is recorded in its log: the seq-0 record of a session published from a dsh
session file (``import``, ``ship``) carries ``dsh.writer: dsh-file`` (:data:`HEADER_WRITER`).
Its events come from dsh, so the driver never writes to it (no crash repair, no turn). A
session whose seq-0 record has no writer header was started by the driver, its one writer.
Headers are ``(str, bytes)`` pairs, the shape aiokafka produces and consumes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from pipeline.core.errors import CodecError
from pipeline.core.events import Event

HEADER_TYPE: Final = "dsh.type"
HEADER_SEQ: Final = "dsh.seq"
HEADER_SCHEMA: Final = "dsh.schema"
HEADER_TRACEPARENT: Final = "traceparent"
# On an inbox record: the tenant of the command, for services that set it as a header
# (pipeline.core.tenants); the same as the record's tenant field when both are given.
HEADER_TENANT: Final = "dsh.tenant"
HEADER_SOURCE_PARTITION: Final = "dsh.source.partition"
HEADER_SOURCE_OFFSET: Final = "dsh.source.offset"
# On a fleet record: the session-topic offset of the session's first event (seq 0), where a
# reader of the whole session starts (the partition is the session's: the fleet topic's).
HEADER_SESSION_FIRST: Final = "dsh.session.first"
HEADER_WRITER: Final = "dsh.writer"
WRITER_DSH_FILE: Final = b"dsh-file"

Headers = list[tuple[str, bytes]]


def record_key(session_id: str) -> bytes:
    """The record key of a session's events and inbox commands."""
    try:
        return session_id.encode("utf-8")
    except UnicodeEncodeError:
        raise CodecError(f"session id {session_id!r} is not valid Unicode") from None


def session_id_of_key(key: bytes | None) -> str:
    """The session id of a record key; a missing or non-UTF-8 key is a CodecError."""
    if key is None:
        raise CodecError("record has no key (expected the session id)")
    try:
        return bytes(key).decode("utf-8")
    except UnicodeDecodeError:
        raise CodecError(f"record key is not UTF-8: {bytes(key)[:40]!r}") from None


def event_headers(event: Event, *, framing: str | None = None,
                  traceparent: str | None = None) -> Headers:
    """The headers of an event's record."""
    headers: Headers = [
        (HEADER_TYPE, event.type.encode("utf-8", "surrogatepass")),
        (HEADER_SEQ, str(event.seq).encode("ascii")),
    ]
    if framing:
        headers.append((HEADER_SCHEMA, framing.encode("ascii")))
    if traceparent:
        headers.append((HEADER_TRACEPARENT, traceparent.encode("ascii")))
    return headers


@dataclass(frozen=True, slots=True)
class HeaderInfo:
    """What the headers say about a record, before (or instead of) decoding its value."""

    type: str | None
    seq: int | None
    framing: str | None
    traceparent: str | None


def read_headers(headers: Iterable[tuple[str, bytes | None]] | None) -> HeaderInfo:
    """Type, seq, framing and traceparent from a record's headers (None when absent).

    A present but malformed ``dsh.seq`` or non-UTF-8 ``dsh.type`` is a CodecError: a
    consumer that trusted it would skip or dedupe the wrong record.
    """
    type_ = seq = framing = trace = None
    for name, value in headers or ():
        if value is None:
            continue
        if name == HEADER_TYPE:
            type_ = _text(name, value)
        elif name == HEADER_SEQ:
            seq = _seq(value)
        elif name == HEADER_SCHEMA:
            framing = _text(name, value)
        elif name == HEADER_TRACEPARENT:
            trace = _text(name, value)
    return HeaderInfo(type_, seq, framing, trace)


def header_type_and_seq(headers: Sequence[tuple[str, bytes | None]] | None
                        ) -> tuple[str | None, int | None]:
    """Shortcut of :func:`read_headers` for the common skip/dedupe decision."""
    info = read_headers(headers)
    return info.type, info.seq


def _text(name: str, value: bytes) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise CodecError(f"header {name} is not UTF-8: {bytes(value)[:40]!r}") from None


def _seq(value: bytes) -> int:
    raw = bytes(value)
    if not raw.isdigit() or len(raw) > 20:
        raise CodecError(f"header {HEADER_SEQ} must be a decimal seq, got {raw[:40]!r}")
    return int(raw)


@dataclass(frozen=True, slots=True, order=True)
class SourcePosition:
    """Where an output value stands in the session topic: every event of its session at or
    before ``offset`` of ``partition`` is folded into it, none after."""

    partition: int
    offset: int


def source_headers(partition: int, offset: int) -> tuple[tuple[str, bytes], ...]:
    """The headers of an output record folded up to ``offset`` of ``partition``."""
    return ((HEADER_SOURCE_PARTITION, str(partition).encode()),
            (HEADER_SOURCE_OFFSET, str(offset).encode()))


def source_position(headers: Iterable[tuple[str, bytes | None]] | None
                    ) -> SourcePosition | None:
    """The position :func:`source_headers` wrote; None when absent or malformed (records
    written before the processors published it, or by another producer)."""
    partition = offset = None
    for name, value in headers or ():
        if name == HEADER_SOURCE_PARTITION:
            partition = value
        elif name == HEADER_SOURCE_OFFSET:
            offset = value
    if partition is None or offset is None:
        return None
    try:
        found = SourcePosition(int(partition), int(offset))
    except (TypeError, ValueError):
        return None
    return found if found.partition >= 0 and found.offset >= 0 else None


def session_first_header(offset: int) -> tuple[str, bytes]:
    return HEADER_SESSION_FIRST, str(offset).encode()


def session_first_offset(headers: Iterable[tuple[str, bytes | None]] | None) -> int | None:
    """The offset :func:`session_first_header` wrote; None when absent or malformed."""
    for name, value in headers or ():
        if name == HEADER_SESSION_FIRST and value is not None:
            try:
                found = int(value)
            except ValueError:
                return None
            return found if found >= 0 else None
    return None


class ConsumedRecord(Protocol):
    """What readers of consumed records use: the Kafka client's own record (read as it is,
    without a copy) or one of ours. A header value may be None (a foreign producer's): treat
    it as an absent header."""

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
