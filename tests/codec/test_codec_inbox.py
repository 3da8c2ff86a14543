"""Inbox commands hold their longs to Avro's 64 bits, as session events do (issue 3)."""

from __future__ import annotations

import copy
from typing import Final

import pytest

from pipeline.codec.inbox import InboxCodec, load_inbox_schema
from pipeline.core.errors import CodecError
from pipeline.core.inbox import Configure, FollowUp

LONG_MAX_VARINT: Final = b"\xfe" + b"\xff" * 8 + b"\x01"
CODEC = InboxCodec()


def _with_max_tokens(varint: bytes) -> bytes:
    data = CODEC.encode(Configure("s", "m", max_tokens=2**63 - 1))
    assert data.count(LONG_MAX_VARINT) == 1
    return data.replace(LONG_MAX_VARINT, varint)


def test_max_tokens_up_to_64_bits_decode() -> None:
    for varint, value in ((LONG_MAX_VARINT, 2**63 - 1), (b"\x82" + b"\x80" * 8 + b"\x00", 1)):
        assert CODEC.decode(_with_max_tokens(varint)) == Configure("s", "m", max_tokens=value)


@pytest.mark.parametrize(("varint", "message"), [
    (LONG_MAX_VARINT[:-1] + b"\x03", "varint of 65 bits"),  # fastavro read 2**63 - 1
    (b"\x80" * 10 + b"\x02", "varint longer than 10 bytes")])  # fastavro read 64
def test_max_tokens_beyond_64_bits_are_refused_naming_the_field(varint: bytes, message: str
                                                                ) -> None:
    with pytest.raises(CodecError, match=rf"dsh\.InboxCommand\.maxTokens: {message}"):
        CODEC.decode(_with_max_tokens(varint))


def test_another_writer_schema_is_still_resolved_and_checked() -> None:
    """A registry schema other than today's (here: a field added at the end) goes through
    fastavro's resolution to today's record, after the same check of its varints."""
    schema = copy.deepcopy(load_inbox_schema())
    schema["fields"].append({"name": "note", "type": ["null", "string"], "default": None})
    writer = InboxCodec(confluent_id=9, writer_schemas_by_id={9: schema})
    reader = InboxCodec(writer_schemas_by_id={9: schema})
    command = FollowUp("s", "m", ({"type": "text", "text": "hi"},))
    framed = writer.encode(command)  # today's fields only: a valid body of the wider schema
    assert reader.decode(framed + b"\x00") == command  # note: null
    bad = writer.encode(Configure("s", "m", max_tokens=2**63 - 1)).replace(
        LONG_MAX_VARINT, b"\x80" * 10 + b"\x02")
    with pytest.raises(CodecError, match=r"maxTokens: varint longer than 10 bytes"):
        reader.decode(bad + b"\x00")
