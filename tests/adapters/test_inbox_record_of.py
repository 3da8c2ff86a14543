"""``inbox_record_of``: the InboxRecord a scan builds from each client record, by setting its
slots directly; it must equal the dataclass's own construction, field for field."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from aiokafka.structs import ConsumerRecord

from pipeline.adapters.kafka.records import CLIENT_RECORD_FIELDS, InboxRecord, inbox_record_of


def test_the_builder_sets_every_field_of_the_dataclass_in_its_order() -> None:
    assert tuple(f.name for f in dataclasses.fields(InboxRecord)) == CLIENT_RECORD_FIELDS


@pytest.mark.parametrize("headers", [[("dsh.seq", b"7"), ("foreign", None)], [], None])
def test_a_client_record_becomes_the_same_inbox_record_as_the_constructor_makes(
        headers: list[tuple[str, bytes | None]] | None) -> None:
    raw = ConsumerRecord(topic="t.session-events", partition=3, offset=41, timestamp=1_700,
                         timestamp_type=0, key=b"s-1", value=b"\x00body", checksum=None,
                         serialized_key_size=3, serialized_value_size=5, headers=headers)
    built = inbox_record_of(raw)
    expected = InboxRecord("t.session-events", 3, 41, b"s-1", b"\x00body",
                           tuple(headers or ()), 1_700)   # type: ignore[arg-type]
    assert built == expected and hash(built) == hash(expected)
    assert type(built.headers) is tuple
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.offset = 42   # type: ignore[misc]
    tombstone = inbox_record_of(SimpleNamespace(**{**vars(raw), "value": None}))
    assert tombstone.value is None and tombstone.key == b"s-1"
