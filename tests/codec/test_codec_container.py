"""``dsh-pipeline encode`` / ``decode``: session files <-> Avro object container files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from shared_paths import SHARED_DIR
from strategies import valid_logs

from pipeline.cli.main import main
from pipeline.codec.avro import EventRecords
from pipeline.codec.container import HEADER_META, read_container, write_container
from pipeline.codec.sessionfile import read_session_file, write_session_file
from pipeline.core.errors import CodecError
from pipeline.core.events import Event

FIXTURES = (SHARED_DIR / "fixtures")
FILES = sorted(FIXTURES.glob("**/*.jsonl"))


def _canonical_lines(path: Path) -> list[str]:
    """The file's events as lines, envelope keys in Event's order (data untouched)."""
    session_file = read_session_file(path)
    return [event.to_line() for event in session_file.events]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_encode_then_decode_gives_the_input_back(path: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    avro = tmp_path / "out.avro"
    assert main(["encode", str(path), "-o", str(avro)]) == 0
    capsys.readouterr()
    assert main(["decode", str(avro)]) == 0
    lines = capsys.readouterr().out.splitlines()
    original = path.read_text(encoding="utf-8").splitlines()
    has_header = json.loads(original[0]).get("type") == "session"
    if has_header:
        assert lines[0] == original[0]
    assert lines[1 if has_header else 0:] == _canonical_lines(path)

    packed = tmp_path / "packed.jsonl.zstd"
    assert main(["decode", str(avro), "--packed", "-o", str(packed)]) == 0
    again = read_session_file(packed)
    assert again.events == read_session_file(path).events
    assert len(packed.read_bytes()) > 0


def test_the_container_is_plain_avro(tmp_path: Path) -> None:
    path = FIXTURES / "dsh-format0" / "tool-call-turn.jsonl"
    avro = tmp_path / "out.avro"
    assert main(["encode", str(path), "-o", str(avro)]) == 0
    with open(avro, "rb") as handle:  # fastavro alone, none of our code
        reader = fastavro.reader(handle)
        records = list(reader)
        assert reader.metadata["avro.codec"] == "deflate"
        header = json.loads(reader.metadata[HEADER_META])
    session_file = read_session_file(path)
    assert header == session_file.header
    assert len(records) == len(session_file.events)
    assert {r["sessionId"] for r in records} == {session_file.session_id}
    assert [r["seq"] for r in records] == [e.seq for e in session_file.events]
    tool_call = next(r for r in records if r["type"] == "tool/call")
    assert tool_call["payload"]["name"] == "bash"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_logs())
def test_generated_logs_survive_the_container(events: list[Event]) -> None:
    out = io.BytesIO()
    assert write_container(out, events, session_id="s", header=None) == len(events)
    out.seek(0)
    container = read_container(out)
    assert container.header is None
    assert [json.dumps(e.to_json()) for _, e in container.events] == [
        json.dumps(e.to_json()) for e in events]


def test_bad_files_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_avro = tmp_path / "x.avro"
    not_avro.write_bytes(b"{\"type\":\"session\"}\n")
    assert main(["decode", str(not_avro)]) == 1
    assert "x.avro: not a readable Avro container" in capsys.readouterr().err
    assert main(["decode", str(tmp_path / "missing.avro")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert main(["encode", str(tmp_path / "missing.jsonl"), "-o", str(not_avro)]) == 1

    merged = tmp_path / "merged.avro"
    records = EventRecords()
    event = Event("turn/start", 0, 1, {"turn": 1})
    with open(merged, "wb") as handle:
        fastavro.writer(handle, records.schema.parsed,
                        [records.to_record("a", event), records.to_record("b", event)])
    assert main(["decode", str(merged)]) == 1
    assert "holds 2 sessions" in capsys.readouterr().err


def test_session_id_comes_from_header_option_or_file_name(tmp_path: Path) -> None:
    source = tmp_path / "my-session.jsonl"
    write_session_file(source, [Event("turn/start", 0, 1, {"turn": 1})])
    for extra, expected in (([], "my-session"), (["--session-id", "other"], "other")):
        avro = tmp_path / "o.avro"
        assert main(["encode", str(source), "-o", str(avro), *extra]) == 0
        with open(avro, "rb") as handle:
            assert read_container(handle).events[0][0] == expected


def _container_with_time(time: int, *, codec: str) -> bytes:
    records = EventRecords()
    out = io.BytesIO()
    fastavro.writer(out, records.schema.parsed,
                    [records.to_record("s", Event("x/y", seq, time, {})) for seq in range(3)],
                    codec=codec)
    return out.getvalue()


def test_a_time_beyond_64_bits_in_a_file_is_refused_naming_the_field() -> None:
    """The records of a container are read by the session topic's decoder (issue 3):
    fastavro's own reader wraps this varint into 2**63 - 1 without a word."""
    data = _container_with_time(2**63 - 1, codec="null")
    long_max = b"\xfe" + b"\xff" * 8 + b"\x01"
    assert data.count(long_max) == 3
    damaged = data.replace(long_max, long_max[:-1] + b"\x03", 1)  # bit 64 set, same length
    assert next(r["time"] for r in fastavro.reader(io.BytesIO(damaged))) == 2**63 - 1
    with pytest.raises(CodecError, match=r"damaged\.avro: .*dsh\.SessionEvent\.time: varint "
                                         r"of 65 bits"):
        read_container(io.BytesIO(damaged), "damaged.avro")
    assert [e.time for _, e in read_container(io.BytesIO(data)).events] == [2**63 - 1] * 3


@pytest.mark.parametrize("codec", ["null", "deflate"])
def test_blocks_are_read_whole_and_only_whole(codec: str) -> None:
    data = _container_with_time(5, codec=codec)
    assert [(s, e.seq) for s, e in read_container(io.BytesIO(data)).events] == [
        ("s", 0), ("s", 1), ("s", 2)]
    sync = data[-16:]  # the file's sync marker ends the header and every block
    block = data.index(sync) + len(sync)  # the one block: record count, size, records
    assert data[block] == 0x06  # 3 records
    for count, message in ((0x04, "trailing bytes after the 2 records of the block"),
                           (0x08, "truncated")):
        damaged = data[:block] + bytes([count]) + data[block + 1:]
        with pytest.raises(CodecError, match=rf"d\.avro: .*{message}"):
            read_container(io.BytesIO(damaged), "d.avro")
