"""The derived outputs as Avro (``pipeline.codec.outputs``): lossless, both framings, every
committed schema version readable, fastavro's bytes, clear errors.

``schemas/history/dsh.<Output>.v<N>.samples.jsonl`` keeps records written with version N
(framed bytes in hex + the JSON object they hold). To add version N+1 of an output schema:
change ``schemas/dsh.<Output>.avsc``, copy it to ``history/dsh.<Output>.v<N+1>.avsc`` and
run ``DSH_WRITE_SCHEMA_SAMPLES=1 .venv/bin/pytest tests/codec/test_codec_outputs.py`` once.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from shared_paths import SHARED_DIR

from pipeline.codec.outputs import (
    DERIVED_MESSAGE_CHANGE,
    FLEET_STATUS,
    OUTPUT_SCHEMAS,
    USAGE_RECORD,
    DerivedChangeSerde,
    OutputCodecs,
    OutputDecoder,
    OutputSchemaTable,
    OutputSerde,
    current_output_schema,
    default_output_codecs,
    output_schema_history,
)
from pipeline.codec.schemas import HISTORY_DIR
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import CodecError, SchemaError
from pipeline.core.fleet import FleetStatus
from pipeline.core.ledger import RowId, ledger_record
from pipeline.core.prices import Cost
from pipeline.core.projection import (
    MessageChange,
    fold_slots,
    rebuild_conversations,
    with_session,
)
from pipeline.core.surface import SurfaceFold
from pipeline.core.usage import TokenCounts, model_record, session_record, window_record

FIXTURES = SHARED_DIR / "fixtures"
LOGS = [*sorted((FIXTURES / "dsh-format0").glob("*.jsonl")), FIXTURES / "seed-example.jsonl"]
COUNTS = TokenCounts(120, 30, 4000, 12, 7, 3)


def _change(message: Any, kind: str = "append") -> MessageChange:
    return MessageChange("s-1", 4, 9, 11, kind, message)  # type: ignore[arg-type]


def _samples() -> dict[str, list[dict[str, Any]]]:
    """JSON objects of every output, corner cases included."""
    fleet = FleetStatus("s-1", "in-turn", 2, 1, "end_turn", None, 1_800_000_000_000, 41, 2,
                        5, 0, 1, 3)
    return {
        DERIVED_MESSAGE_CHANGE: [c.to_json() or {} for c in (
            _change({"role": "user", "content": [{"type": "text", "text": "hi é 🙂"}]}),
            _change({"z": 1, "a": [1.5, None, True], "big": 10**30}, "replace"),
            _change({"role": "user", "content": [{"type": "text", "text": "lone \ud800"}]}),
            _change(None))],
        USAGE_RECORD: [session_record("s-1", COUNTS), model_record("deepseek", "chat", COUNTS),
                       window_record(["minute", 60_000, 120_000, "p", "m"], COUNTS,
                                     closed=True),
                       window_record(["hour", 0, 3_600_000, "p", "m"], TokenCounts(),
                                     closed=False),
                       # v2: cost on model totals, the ledger's tenant rows
                       model_record("deepseek", "chat", COUNTS,
                                    Cost(1_234_567_890_123, 3, 1, 50).record_fields()),
                       ledger_record(RowId("acme", 3_600_000, "deepseek", "chat"), COUNTS,
                                     Cost(10**21, 3)),
                       ledger_record(RowId("", 0, "p", "m/with/slash"), COUNTS,
                                     Cost(0, 0, 3, 4132))],
        FLEET_STATUS: [FleetStatus("s-2").to_json(), fleet.to_json(), FleetStatus(
            "s-3", "in-turn", 1, 1, None, None, 1_800_000_000_000, 9, 1, 1, 0, 0, 0,
            "call-1", "mcp__git__push", 1_800_000_000_000).to_json(),  # waits for approval
            FleetStatus("s-4", "in-turn", 3, 2, None, None, 1_800_000_000_000, 77, 3, 4, 0, 0,
                        0, tenant="acme", provider_wait="deepseek/deepseek-chat",
                        provider_wait_since_ms=1_799_999_999_000).to_json()],
    }


def _serde(name: str) -> OutputSerde:
    codecs = default_output_codecs()
    return {DERIVED_MESSAGE_CHANGE: codecs.derived, USAGE_RECORD: codecs.usage,
            FLEET_STATUS: codecs.fleet}[name]


@pytest.mark.parametrize("name", OUTPUT_SCHEMAS)
def test_json_avro_json_is_identical_key_order_included(name: str) -> None:
    serde = _serde(name)
    for value in _samples()[name]:
        data = serde.encode(value)
        assert data is not None and data[:2] == b"\xc3\x01"
        assert json.dumps(OutputDecoder().decode(data)) == json.dumps(value)


@pytest.mark.parametrize("name", OUTPUT_SCHEMAS)
def test_the_bytes_are_fastavros(name: str) -> None:
    writer = current_output_schema(name)
    parsed = parse_schema(writer.schema)
    for value in _samples()[name]:
        record = writer.to_record(value, ascii_json=True)  # fastavro refuses lone surrogates
        reference = io.BytesIO()
        schemaless_writer(reference, parsed, record)
        ours = bytearray()
        writer.binary.encode_into(ours, record)
        assert bytes(ours) == reference.getvalue()


def test_a_change_encodes_as_its_json_and_a_removal_is_a_tombstone() -> None:
    serde = default_output_codecs().derived
    for value in _samples()[DERIVED_MESSAGE_CHANGE]:
        change = MessageChange(str(value["session"]), int(value["slot"]), int(value["seq"]),
                               int(value["changeSeq"]), value["op"], value["message"])
        assert serde.encode_change(change) == serde.encode(value)
    assert serde.encode_change(_change(None, "remove")) is None
    assert serde.encode(None) is None and serde.decode(None) is None


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.stem)
def test_fixture_changes_through_avro_rebuild_the_recorded_derivation(path: Path) -> None:
    serde, reader = DerivedChangeSerde(), OutputDecoder()
    expected = json.loads(path.with_name(path.stem + ".derived.json").read_text())
    slots, records = SurfaceFold(keep_messages=False), []
    for event in read_session_file(path).events:
        changes = with_session(fold_slots(slots, event), "s-1")
        records += [(c.key, reader.decode(serde.encode_change(c))) for c in changes]
    assert rebuild_conversations(records)["s-1"] == expected


def test_confluent_framing_with_registry_ids_and_lookup() -> None:
    ids = {DERIVED_MESSAGE_CHANGE: 7, USAGE_RECORD: 8, FLEET_STATUS: 2**32 - 1}
    writer = OutputCodecs.confluent(ids, lookup=None)
    data = writer.usage.encode(_samples()[USAGE_RECORD][0])
    assert data is not None and data[:5] == b"\x00\x00\x00\x00\x08"
    texts = {i: current_output_schema(n).text() for n, i in ids.items()}
    reader = OutputDecoder(OutputSchemaTable(texts.__getitem__))  # a fresh reader fetches
    assert reader.decode(data) == _samples()[USAGE_RECORD][0]
    fleet = writer.fleet.encode(_samples()[FLEET_STATUS][1])
    assert reader.decode(fleet or b"") == _samples()[FLEET_STATUS][1]
    with pytest.raises(SchemaError, match="unknown registry schema id 8"):
        OutputDecoder().decode(data)
    with pytest.raises(CodecError, match="does not fit 4 bytes"):
        OutputSerde(USAGE_RECORD, schema_id=2**32)


def test_a_registry_id_of_another_schema_is_refused() -> None:
    inbox = (Path(__file__).resolve().parents[2] / "schemas/dsh.InboxCommand.avsc")
    reader = OutputDecoder(OutputSchemaTable(lambda _id: inbox.read_text()))
    with pytest.raises(SchemaError, match="not an output record schema"):
        reader.decode(b"\x00\x00\x00\x00\x05\x00")


def test_values_written_before_the_outputs_were_avro_still_read() -> None:
    value = _samples()[USAGE_RECORD][1]
    assert OutputDecoder().decode(json.dumps(value).encode()) == value


@pytest.mark.parametrize("data, match", [
    (b"", "not a framed Avro output record: 0 bytes"),
    (b"garbage!", "not a framed Avro output record"),
    (b"\xc3\x01" + bytes(8) + b"\x02", "unknown writer schema fingerprint"),
    (b"{not json", "is not JSON"),
    (b"[1, 2]", "not a framed Avro output record"),
])
def test_undecodable_values_are_clear_errors(data: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        OutputDecoder().decode(data)


def test_truncated_and_trailing_bytes_are_errors() -> None:
    data = default_output_codecs().fleet.encode(_samples()[FLEET_STATUS][1]) or b""
    with pytest.raises(CodecError, match=r"truncated|undecodable"):
        OutputDecoder().decode(data[:-3])
    with pytest.raises(CodecError, match="trailing bytes"):
        OutputDecoder().decode(data + b"\x00")


def test_values_that_do_not_fit_are_refused_never_dropped() -> None:
    usage = default_output_codecs().usage
    with pytest.raises(CodecError, match=r"keys \['gen_ai.usage.total_tokens'\] are not fields"):
        usage.encode({**_samples()[USAGE_RECORD][0], "gen_ai.usage.total_tokens": 1})
    with pytest.raises(CodecError, match=r"keys \['kind'\] are missing"):
        usage.encode({k: v for k, v in _samples()[USAGE_RECORD][0].items() if k != "kind"})
    with pytest.raises(CodecError, match=r"keys \['granularity'\] are null"):
        usage.encode({**_samples()[USAGE_RECORD][0], "granularity": None})  # null = absent
    fleet = _samples()[FLEET_STATUS][0]
    with pytest.raises(CodecError, match=r"keys \['step'\] are missing"):
        default_output_codecs().fleet.encode({k: v for k, v in fleet.items() if k != "step"})
    with pytest.raises(CodecError, match="does not fit"):
        usage.encode({**_samples()[USAGE_RECORD][0], "dsh.usage.calls": 2**64})
    with pytest.raises(CodecError, match="not lossless JSON"):
        default_output_codecs().derived.encode_change(_change({"x": float("nan")}))
    with pytest.raises(CodecError, match="UTF-8 cannot encode"):
        default_output_codecs().fleet.encode({**_samples()[FLEET_STATUS][0],
                                              "session_id": "bad \udc80"})


def test_usage_field_names_map_to_the_exported_open_telemetry_names() -> None:
    schema = current_output_schema(USAGE_RECORD).schema
    named = {f["name"]: f.get("dsh.name", f["name"]) for f in schema["fields"]}
    exported = set(session_record("s", COUNTS)) | set(model_record("p", "m", COUNTS)) | set(
        window_record(["minute", 0, 1, "p", "m"], COUNTS, closed=False)) | set(
        ledger_record(RowId("t", 0, "p", "m"), COUNTS, Cost(1, 1, 1, 1)))
    assert set(named.values()) == exported
    for avro_name, key in named.items():
        assert avro_name == key.replace(".", "_")


# --- schema history -----------------------------------------------------------------------

def _samples_path(name: str, version: int) -> Path:
    return HISTORY_DIR / f"{name}.v{version}.samples.jsonl"


def _write_samples(name: str, version: int) -> None:
    serde = _serde(name)
    with open(_samples_path(name, version), "w", encoding="utf-8") as handle:
        for value in _samples()[name]:
            data = serde.encode(value) or b""
            handle.write(json.dumps({"hex": data.hex(),
                                     "value": json.dumps(value, ensure_ascii=True)}) + "\n")


@pytest.mark.parametrize("name", OUTPUT_SCHEMAS)
def test_current_output_schema_is_the_latest_committed_version(name: str) -> None:
    history = output_schema_history(name)
    assert [s.version for s in history] == list(range(1, len(history) + 1))
    assert history[-1].schema == current_output_schema(name).schema, (
        f"schemas/{name}.avsc changed: commit it as a new history version "
        "(see schemas/README.md)")


@pytest.mark.parametrize("name", OUTPUT_SCHEMAS)
def test_records_written_with_every_version_decode_today(name: str) -> None:
    latest = output_schema_history(name)[-1].version or 0
    if os.environ.get("DSH_WRITE_SCHEMA_SAMPLES") and not _samples_path(name, latest).exists():
        _write_samples(name, latest)
    for schema in output_schema_history(name):
        lines = _samples_path(name, schema.version or 0).read_text().splitlines()
        assert lines, f"no samples for {name} v{schema.version}"
        for line in lines:
            sample = json.loads(line)
            data = bytes.fromhex(sample["hex"])
            assert data[2:10] == schema.fingerprint
            assert json.dumps(OutputDecoder().decode(data), ensure_ascii=True) == \
                sample["value"]


@pytest.mark.parametrize("name", OUTPUT_SCHEMAS)
def test_todays_reader_schema_resolves_every_old_version(name: str) -> None:
    """BACKWARD_TRANSITIVE as Avro resolution: what Spark, DuckDB or Java readers do."""
    reader = parse_schema(current_output_schema(name).schema)
    for old in output_schema_history(name):
        lines = _samples_path(name, old.version or 0).read_text().splitlines()
        for line in lines:
            body = io.BytesIO(bytes.fromhex(json.loads(line)["hex"])[10:])
            record = schemaless_reader(body, parse_schema(old.schema), reader)
            assert isinstance(record, dict) and record.keys() == {
                f["name"] for f in current_output_schema(name).schema["fields"]}


def test_a_record_of_another_output_schema_is_refused_when_one_is_expected() -> None:
    fleet = default_output_codecs().fleet.encode(_samples()[FLEET_STATUS][0])
    decoder = OutputDecoder()
    assert decoder.decode(fleet, FLEET_STATUS) == _samples()[FLEET_STATUS][0]
    with pytest.raises(CodecError, match=r"a dsh\.FleetStatus record where "
                                         r"dsh\.DerivedMessageChange was expected"):
        decoder.decode(fleet, DERIVED_MESSAGE_CHANGE)
