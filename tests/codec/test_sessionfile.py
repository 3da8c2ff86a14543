"""Session files: packed rows, zstd, torn tails, seq gaps, round trips, and no crash on junk."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_paths import SHARED_DIR
from strategies import valid_logs

from pipeline.cli.main import main
from pipeline.codec.packed_chunks import expand_packed_row
from pipeline.codec.sessionfile import (
    encode_lines,
    load_session,
    read_session_file,
    scan_session_file,
    write_session_file,
)
from pipeline.core.errors import DshError, SessionFileError
from pipeline.core.events import Event

FIXTURES = sorted((SHARED_DIR / "fixtures/dsh-format0").glob("*.jsonl"))
TEXT_TURN = (SHARED_DIR / "fixtures/dsh-format0/text-turn.jsonl")
HEADER = {"type": "session", "version": 0, "id": "s-1", "createdAt": 0}


def test_packed_row_expands_to_consecutive_chunks_with_cumulative_times() -> None:
    row = json.loads(TEXT_TURN.read_text().splitlines()[11])
    assert row["type"] == "reasoning-chunks"
    events = expand_packed_row(row)
    assert [e.seq for e in events] == list(range(10, 30))
    times = [row["time0"]]
    for gap in row["data"]["dt"]:
        times.append(times[-1] + gap)
    assert [e.time for e in events] == times
    assert events[11].data == {"turn": 1, "step": 1,
                               "chunk": {"type": "reasoning-delta", "index": 0, "text": "P"}}


def test_tool_call_rows_put_id_and_name_on_every_delta() -> None:
    row = {"type": "tool-call-chunks", "seq0": 5, "time0": 10,
           "data": {"turn": 1, "step": 2, "index": 1, "dt": [3], "id": "c", "name": "bash",
                    "args": ["{", "}"]}}
    assert [e.data["chunk"] for e in expand_packed_row(row)] == [
        {"type": "tool-call-delta", "index": 1, "id": "c", "name": "bash", "argumentsDelta": a}
        for a in ("{", "}")]
    del row["data"]["name"]  # type: ignore[attr-defined]
    assert "name" not in expand_packed_row(row)[0].data["chunk"]


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_packed_writing_reproduces_dsh_lines(path: Path) -> None:
    read = read_session_file(path)
    original = [json.loads(line) for line in path.read_text().splitlines() if line]
    written = [json.loads(line) for line in encode_lines(read.events, header=read.header,
                                                          packed=True)]
    assert written == original


@pytest.mark.parametrize("name", ["s.jsonl", "s.jsonl.zstd"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_fixture_round_trip(path: Path, packed: bool, name: str, tmp_path: Path) -> None:
    first = read_session_file(path)
    out = tmp_path / name
    write_session_file(out, first.events, header=first.header, packed=packed)
    again = read_session_file(out)
    assert again.events == first.events and again.header == first.header
    assert again.warnings == ()
    if not packed and name.endswith(".jsonl"):
        write_session_file(tmp_path / "b.jsonl", again.events, header=again.header)
        assert (tmp_path / "b.jsonl").read_bytes() == out.read_bytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(valid_logs(), st.booleans(), st.booleans())
def test_generated_logs_round_trip(tmp_path: Path, events: list[Event], packed: bool,
                                   zstd: bool) -> None:
    out = tmp_path / ("g.jsonl.zstd" if zstd else "g.jsonl")
    write_session_file(out, events, header=HEADER, packed=packed)
    assert read_session_file(out).events == tuple(events)


def write_lines(path: Path, lines: list[str], *, terminated: bool = True) -> Path:
    path.write_text("\n".join(lines) + ("\n" if terminated else ""), encoding="utf-8")
    return path


def fixture_lines() -> list[str]:
    return TEXT_TURN.read_text().splitlines()


def test_torn_last_line_is_dropped_with_a_warning(tmp_path: Path) -> None:
    lines = fixture_lines()
    torn = write_lines(tmp_path / "t.jsonl", [*lines[:-1], lines[-1][:25]], terminated=False)
    read = read_session_file(torn)
    assert len(read.events) == 39 and read.events[-1].type == "step/end"
    assert len(read.warnings) == 1 and "torn last line" in read.warnings[0]
    assert f"{torn}:22" in read.warnings[0]


def test_a_bad_line_that_is_not_the_torn_tail_is_an_error(tmp_path: Path) -> None:
    lines = fixture_lines()
    bad = write_lines(tmp_path / "b.jsonl", [*lines[:-1], lines[-1][:25]], terminated=True)
    with pytest.raises(SessionFileError) as info:
        read_session_file(bad)
    assert info.value.path == str(bad) and info.value.line == 22
    assert "not valid JSON" in str(info.value)


def test_seq_gap_is_refused_naming_path_and_line(tmp_path: Path) -> None:
    lines = fixture_lines()
    gap = write_lines(tmp_path / "g.jsonl", lines[:5] + lines[6:])
    with pytest.raises(SessionFileError) as info:
        read_session_file(gap)
    assert info.value.line == 6
    assert str(info.value).startswith(f"{gap}:6: seq gap: expected seq 4, found 5")


def test_unsupported_header_version_is_refused(tmp_path: Path) -> None:
    lines = fixture_lines()
    path = write_lines(tmp_path / "v.jsonl", [lines[0].replace('"version":0', '"version":7'),
                                              *lines[1:]])
    with pytest.raises(SessionFileError, match=r":1: unsupported session format version 7"):
        read_session_file(path)


@pytest.mark.parametrize("literal", ["-0", "-0.0", "NaN", "1e400", "-Infinity"])
def test_non_lossless_numbers_are_refused_at_parse_time(tmp_path: Path, literal: str) -> None:
    path = write_lines(tmp_path / "n.jsonl", [
        '{"type":"turn/start","seq":0,"time":0,"data":{"turn":1,"x":' + literal + "}}"])
    with pytest.raises(SessionFileError, match="not lossless JSON"):
        read_session_file(path)


def test_torn_zstd_frame_is_dropped_with_a_warning(tmp_path: Path) -> None:
    read = read_session_file(TEXT_TURN)
    path = tmp_path / "z.jsonl.zstd"
    write_session_file(path, read.events[:30], header=read.header, packed=True)
    tail = zstandard.ZstdCompressor().compress(
        "".join(e.to_line() + "\n" for e in read.events[30:]).encode())
    with path.open("ab") as handle:
        handle.write(tail[: len(tail) // 2])
    again = read_session_file(path)
    assert again.events == read.events[:30]
    assert any("torn zstd frame" in w for w in again.warnings)
    with path.open("ab") as handle:  # the rest arrives: both frames read
        handle.write(tail[len(tail) // 2:])
    assert read_session_file(path).events == read.events


def test_concatenated_frames_of_any_size_are_read(tmp_path: Path) -> None:
    lines = [line + "\n" for line in fixture_lines()]
    compressor = zstandard.ZstdCompressor()
    path = tmp_path / "c.jsonl.zstd"
    path.write_bytes(b"".join(compressor.compress("".join(lines[i:i + 3]).encode())
                              for i in range(0, len(lines), 3)))
    assert read_session_file(path).events == read_session_file(TEXT_TURN).events


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400), st.sampled_from(["r.jsonl", "r.jsonl.zstd"]),
       st.booleans())
def test_random_bytes_never_crash_the_reader(tmp_path: Path, junk: bytes, name: str,
                                             zstd_magic: bool) -> None:
    path = tmp_path / name
    path.write_bytes((b"\x28\xb5\x2f\xfd" if zstd_magic else b"") + junk)
    with contextlib.suppress(DshError):
        load_session(path)


ODD_VALUES = (None, [], {}, [1], {"a": None}, "s", "", -1, 0, 1.5, 2**70, True, "\ud83d")


def mutate_structure(line: str, rng: random.Random) -> str:
    """Parse the line, replace one random subtree by an odd value, dump it again."""
    value = json.loads(line)
    parent: list[tuple[object, object]] = []
    stack = [value]
    while stack:
        node = stack.pop()
        children = (list(node.items()) if isinstance(node, dict)
                    else list(enumerate(node)) if isinstance(node, list) else [])
        for key, child in children:
            parent.append((node, key))
            stack.append(child)
    if not parent:
        return json.dumps(rng.choice(ODD_VALUES))
    node, key = rng.choice(parent)
    node[key] = rng.choice(ODD_VALUES)  # type: ignore[index]
    return json.dumps(value)


def mutate(line: str, rng: random.Random) -> str:
    choice = rng.randrange(7)
    if not line.strip():
        return json.dumps(rng.choice(ODD_VALUES))
    if choice >= 5:
        try:
            return mutate_structure(line, rng)
        except ValueError:  # an earlier mutation already broke the JSON
            return line[::-1]
    if choice == 0:
        return line[: rng.randrange(len(line) + 1)]
    if choice == 1:
        position = rng.randrange(len(line))
        return line[:position] + rng.choice('{}[]":,0-9eE\\ ') + line[position + 1:]
    if choice == 2:
        return line.replace(rng.choice(['"seq"', '"data"', '"turn"', '"type"', '"surfaceOp"',
                                        '"texts"', '"dt"', '"id"', '"role"']), '"x"', 1)
    if choice == 3:
        return line.replace(":1", ":-0", 1).replace("[", "[null,", 1)
    return json.dumps(rng.choice([None, [], {}, "s", 1.5, {"type": "text-chunks", "seq0": 3}]))


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(FIXTURES), st.randoms(use_true_random=False))
def test_mutated_lines_give_clear_errors_never_tracebacks(tmp_path: Path, fixture: Path,
                                                          rng: random.Random) -> None:
    lines = fixture.read_text().splitlines()
    for _ in range(rng.randint(1, 3)):
        index = rng.randrange(len(lines))
        lines[index] = mutate(lines[index], rng)
    path = write_lines(tmp_path / "m.jsonl", lines)
    for mode in ("ingest", "strict"):
        try:
            load_session(path, mode=mode)  # type: ignore[arg-type]
        except DshError as exc:
            assert str(exc)
    scan_session_file(path)


def test_validate_prints_one_line_per_problem_and_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = fixture_lines()
    bad_json = write_lines(tmp_path / "a.jsonl", [*lines[:3], "{oops", *lines[3:]])
    bad_rule = write_lines(tmp_path / "b.jsonl", [
        *lines[:5], lines[5].replace('"role":"user"', '"role":"robot"'), *lines[6:]])
    good = str(FIXTURES[0])
    assert main(["validate", good, str(bad_json), str(bad_rule)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{good}: valid (45 events)"
    assert out[1].startswith(f"{bad_json}:4: not valid JSON")
    assert out[2] == (f"{bad_rule}:6: seq 4, type user/message: data.role must be 'user' "
                      "[rule: message-role]")
    assert len(out) == 3


def test_validate_strict_and_ingest(capsys: pytest.CaptureFixture[str]) -> None:
    seed = str(SHARED_DIR / "fixtures/seed-example.jsonl")
    assert main(["validate", seed]) == 0
    assert main(["validate", "--strict", seed]) == 1
    assert "[rule: message-id]" in capsys.readouterr().out


def test_write_failure_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SessionFileError, match="cannot write"):
        write_session_file(tmp_path / "missing-dir" / "x.jsonl", [])


def test_lone_surrogates_read_in_ingest_refused_in_strict_and_written_escaped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """JavaScript can write "\\ud83d" (a string cut inside an emoji): carry it, escaped."""
    lines = fixture_lines()
    path = write_lines(tmp_path / "s.jsonl", [
        *lines[:5], lines[5].replace("Reply with", "Reply \\ud83d with"), *lines[6:]])
    _, log = load_session(path)
    assert "\ud83d" in log.messages()[0]["content"][0]["text"]
    assert main(["derive", "--json", str(path)]) == 0
    assert "\\ud83d" in capsys.readouterr().out
    assert main(["derive", str(path)]) == 0
    assert main(["validate", "--strict", str(path)]) == 1
    assert "[rule: lossless-json]" in capsys.readouterr().out
    out = tmp_path / "again.jsonl"
    write_session_file(out, read_session_file(path).events, packed=True)
    assert read_session_file(out).events == read_session_file(path).events


def test_crlf_blank_lines_and_a_byte_order_mark_are_tolerated(tmp_path: Path) -> None:
    lines = fixture_lines()
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n\r\n".join(lines).encode() + b"\r\n")
    read = read_session_file(path)
    assert read.events == read_session_file(TEXT_TURN).events
    assert read.line_of(0) == 3 and read.header is not None


def test_validate_reports_an_unreadable_file_and_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.jsonl"
    assert main(["validate", str(missing), str(TEXT_TURN)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{missing}: cannot read")
    assert out[1] == f"{TEXT_TURN}: valid (40 events)"


def test_validate_reports_every_refused_event_not_just_the_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = fixture_lines()
    bad = [line.replace('"role":"user"', '"role":"robot"') for line in lines]
    path = write_lines(tmp_path / "two.jsonl", bad)
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[0] for line in out] == [f"{path}:6", f"{path}:7"]
    assert all(line.endswith("[rule: message-role]") for line in out)


@pytest.mark.parametrize("line", [
    '{"type":[1],"seq":0,"time":0,"data":{}}',
    '{"type":{"a":1},"seq0":0,"time0":0,"data":{}}',
    '{"type":"text-chunks","seq0":0,"time0":0,"data":{"turn":1,"step":1,"index":0,'
    '"dt":[1.5],"texts":["a","b"]}}',
    '{"type":"tool-call-chunks","seq0":0,"time0":0,"data":{"turn":1,"step":1,"index":0,'
    '"dt":[],"id":["x"],"args":["a"]}}',
    '[]', '"session"', "null", '{"type":"session","version":0}',
])
def test_odd_rows_are_clear_errors(tmp_path: Path, line: str) -> None:
    path = write_lines(tmp_path / "odd.jsonl", [line])
    with pytest.raises(SessionFileError) as info:
        load_session(path)
    assert str(info.value).startswith(f"{path}:1: ")
