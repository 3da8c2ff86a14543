"""Every committed schema version stays readable; adding an event type is compatible.

``schemas/history/dsh.SessionEvent.v<N>.avsc`` keeps every version, and beside each a sample
file ``dsh.SessionEvent.v<N>.samples.jsonl`` of records written with that version (framed
bytes in hex + the event they hold). To add version N+1: change ``schemas/
dsh.SessionEvent.avsc``, copy it to ``history/dsh.SessionEvent.v<N+1>.avsc`` and run
``DSH_WRITE_SCHEMA_SAMPLES=1 .venv/bin/pytest tests/codec/test_schema_evolution.py`` once to write
its samples (older samples are never rewritten).
"""

from __future__ import annotations

import copy
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from hypothesis import HealthCheck, given, settings
from shared_paths import SHARED_DIR
from test_codec_binary import datums

from pipeline.codec.avro import EventRecords, EventSerde
from pipeline.codec.schemas import (
    HISTORY_DIR,
    SchemaTable,
    WriterSchema,
    current_event_schema,
    event_schema_history,
)
from pipeline.core.events import APPEND, Event, event_from_json

FIXTURES = (SHARED_DIR / "fixtures")


def _sample_events() -> list[tuple[str, Event]]:
    out = []
    for path in sorted(FIXTURES.glob("**/*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            obj = json.loads(line)
            if "seq" in obj and obj.get("type") != "session":
                out.append((path.stem, event_from_json(obj)))
    out += [  # the fallbacks and corner cases, too
        ("tricky", Event("turn/start", 0, -1, {"turn": "one"})),
        ("tricky", Event("assistant/chunk", 1, 2, {"step": 1, "x": None, "turn": 1,
                                                    "chunk": {"a": 1.0, "b": 10**30}})),
        ("tricky", Event("user/message", 2, 3, {"role": "user", "content": [
            {"type": "text", "text": "lone \ud800"}]}, APPEND, (), False)),
        ("tricky", Event("x/unknown", 3, 4, [1, "two", None], None, None, True)),
    ]
    return out


def _samples_path(version: int) -> Path:
    return HISTORY_DIR / f"dsh.SessionEvent.v{version}.samples.jsonl"


def _write_samples(version: int) -> None:
    serde = EventSerde()
    with open(_samples_path(version), "w", encoding="utf-8") as handle:
        for session_id, event in _sample_events():
            hexed = serde.encode(session_id, event).hex()
            line = {"sessionId": session_id, "hex": hexed,
                    "event": json.dumps(event.to_json(), ensure_ascii=True)}
            handle.write(json.dumps(line) + "\n")


def test_current_schema_is_the_latest_committed_version() -> None:
    history = event_schema_history()
    assert [s.version for s in history] == list(range(1, len(history) + 1))
    assert history[-1].schema == current_event_schema().schema, (
        "schemas/dsh.SessionEvent.avsc changed: commit it as a new history version "
        "(see schemas/README.md)")


def test_records_written_with_every_version_decode_today() -> None:
    history = event_schema_history()
    latest = history[-1].version
    assert latest is not None
    if os.environ.get("DSH_WRITE_SCHEMA_SAMPLES") and not _samples_path(latest).exists():
        _write_samples(latest)
    reader = EventSerde()
    for schema in history:
        assert schema.version is not None
        lines = _samples_path(schema.version).read_text(encoding="utf-8").splitlines()
        assert lines, f"no samples for v{schema.version}"
        for line in map(json.loads, lines):
            data = bytes.fromhex(line["hex"])
            assert data[2:10] == schema.fingerprint
            session_id, event = reader.decode(data)
            assert session_id == line["sessionId"]
            assert json.dumps(event.to_json(), ensure_ascii=True) == line["event"]


def _resolves(writer: dict[str, Any], reader: dict[str, Any], datum: Any) -> Any:
    out = io.BytesIO()
    schemaless_writer(out, writer, datum)
    out.seek(0)
    return schemaless_reader(out, writer, reader)


@pytest.mark.parametrize("version", [s.version for s in event_schema_history()])
def test_todays_reader_schema_resolves_every_old_version(version: int) -> None:
    """What Spark or a Java consumer does with the registry: read old data through
    today's schema by Avro schema resolution (BACKWARD_TRANSITIVE)."""
    old = next(s for s in event_schema_history() if s.version == version).parsed
    today = current_event_schema().parsed

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(datums(old, old["__named_schemas"]))
    def check(datum: Any) -> None:
        _resolves(old, today, datum)

    check()


def with_new_event_type(schema: dict[str, Any]) -> dict[str, Any]:
    """The documented way to add a typed event type: append a record to the payload union."""
    evolved = copy.deepcopy(schema)
    payload = next(f for f in evolved["fields"] if f["name"] == "payload")
    payload["type"].append({
        "type": "record", "name": "SessionTitle", "dsh.eventTypes": ["session/title"],
        "fields": [
            {"name": "title", "type": "string"},
            {"name": "messageSeqs", "type": ["null", "string"], "default": None,
             "dsh.json": True},
            {"name": "extra", "type": ["null", "string"], "default": None, "dsh.json": True},
            {"name": "keyOrder", "type": ["null", {"type": "array", "items": "string"}],
             "default": None},
        ]})
    return evolved


def test_adding_an_event_type_is_compatible_and_old_readers_survive_it() -> None:
    evolved = WriterSchema.from_json(with_new_event_type(current_event_schema().schema))
    # New readers read old data (what the registry's BACKWARD_TRANSITIVE checks).
    old_event = Event("session/title", 0, 1, {"title": "t", "messageSeqs": [4]})
    old_record = EventRecords().to_record("s", old_event)
    resolved = _resolves(current_event_schema().parsed, evolved.parsed, old_record)
    assert resolved["payload"]["data"] == '{"title":"t","messageSeqs":[4]}'

    # New data, written with the new typed record, is read exactly by today's decoder:
    # it decodes with the writer schema it fetches by registry id.
    writer = EventRecords(evolved)
    record = writer.to_record("s", old_event)
    assert record["payload"][0] == "dsh.SessionTitle"
    framed = bytearray(b"\x00" + (77).to_bytes(4, "big"))
    evolved.binary.encode_into(framed, record)
    today = EventSerde(SchemaTable(lambda schema_id: evolved.text()))
    assert today.decode(bytes(framed)) == ("s", old_event)


def test_an_incompatible_change_is_caught_by_resolution() -> None:
    broken = copy.deepcopy(current_event_schema().schema)
    broken["fields"].append({"name": "partition", "type": "int"})  # required, no default
    record = EventRecords().to_record("s", Event("turn/start", 0, 1, {"turn": 1}))
    with pytest.raises(SchemaResolutionError):
        _resolves(current_event_schema().parsed, parse_schema(broken), record)
