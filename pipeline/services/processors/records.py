"""What the session folds read off a record before deciding: its chunk seq (without decoding
it), its session, and whether its seq is applied, a duplicate or a gap."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from pipeline.codec.records import HEADER_SEQ, HEADER_TYPE, session_id_of_key
from pipeline.core.dedup import Delivery
from pipeline.core.errors import CodecError
from pipeline.core.events import dumps_json

CHUNK: Final = "assistant/chunk"
_CHUNK_TYPE: Final = CHUNK.encode()


def classify(expected: int, seq: int) -> Delivery:
    if seq < expected:
        return Delivery.DUPLICATE
    return Delivery.GAP if seq > expected else Delivery.APPLY


def json_bytes(value: Any) -> bytes | None:
    return None if value is None else dumps_json(value).encode("utf-8")


def chunk_seq(headers: Iterable[tuple[str, bytes | None]] | None) -> int | None:
    """The seq of a chunk record from its headers; None for any other or unreadable record.

    The hot path of the worker (most records are chunks), hence no general header parsing:
    as in :func:`pipeline.codec.records.read_headers` the last header of a name wins, and a
    record whose headers are malformed is left to decoding, which decides (and dead-letters).
    """
    type_ = seq = None
    for name, value in headers or ():
        if name == HEADER_TYPE:
            type_ = value
        elif name == HEADER_SEQ:
            seq = value
    if type_ != _CHUNK_TYPE or seq is None or len(seq) > 20 or not seq.isdigit():
        return None
    return int(seq)


def session_of(key: bytes | None) -> str | None:
    try:
        return session_id_of_key(key)
    except CodecError:
        return None  # decoding decides (and dead-letters)


