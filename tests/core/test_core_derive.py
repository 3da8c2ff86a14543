"""Every fixture derives exactly its ``.derived.json``: library and ``derive --json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shared_paths import SHARED_DIR

from pipeline.cli.main import main
from pipeline.codec.sessionfile import load_session, read_session_file
from pipeline.core.errors import EventError, SessionFileError
from pipeline.core.log import SessionLog, derive_messages

FIXTURES = (SHARED_DIR / "fixtures")
DSH_LOGS = sorted((FIXTURES / "dsh-format0").glob("*.jsonl"))
ALL_LOGS = [*DSH_LOGS, FIXTURES / "seed-example.jsonl"]


def expected(path: Path) -> object:
    return json.loads(path.with_name(path.name.removesuffix(".jsonl") + ".derived.json")
                      .read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", ALL_LOGS, ids=lambda p: p.stem)
def test_fixture_derives_exactly_its_derived_json(path: Path) -> None:
    _, log = load_session(path)
    assert list(log.messages()) == expected(path)
    assert list(derive_messages(read_session_file(path).events)) == expected(path)


@pytest.mark.parametrize("path", ALL_LOGS, ids=lambda p: p.stem)
def test_derive_json_prints_one_array_equal_to_derived_json(
        path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["derive", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert json.loads(out) == expected(path)


@pytest.mark.parametrize("path", DSH_LOGS, ids=lambda p: p.stem)
def test_dsh_recordings_pass_strict_mode(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, log = load_session(path, mode="strict")
    assert list(log.messages()) == expected(path)
    assert main(["derive", "--json", "--strict", str(path)]) == 0
    assert json.loads(capsys.readouterr().out) == expected(path)


def test_seed_example_is_ingest_only() -> None:
    path = FIXTURES / "seed-example.jsonl"
    with pytest.raises(SessionFileError) as info:
        load_session(path, mode="strict")
    assert isinstance(info.value.__cause__, EventError)
    assert info.value.__cause__.rule == "message-id"
    assert f"{path}:3:" in str(info.value)


def test_derive_view_shows_boundaries_chunks_calls_and_messages(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["derive", str(FIXTURES / "seed-example.jsonl")]) == 0
    out = capsys.readouterr().out
    for expected_line in ("[turn/start] turn=1", "  [step/start] turn=1 step=1",
                          "    chunk: text-delta", "    chunk: tool-call-delta",
                          '    tool/call: bash args={"command":"grep ejemplo README.md"}',
                          "  [step/end]   turn=1 step=1",
                          '[turn/end]   turn=1 reason={"kind":"completed"}',
                          "  [user] Fix the typo in the ejemplo README.",
                          "  [tool] bash: ejemplo"):
        assert expected_line in out.splitlines()


def test_derive_at_seq_gives_what_the_model_saw_then(capsys: pytest.CaptureFixture[str]) -> None:
    path = DSH_LOGS[0]  # agent-instructions: seq 17 replaces seq 5 mid-step
    _, log = load_session(path)
    before, after = log.messages_at(16), log.messages_at(17)
    assert len(before) == len(after)
    assert before[1]["id"] == "4cba1848-cbb7-46fd-8cea-8497d54d0e63"
    assert after[1]["id"] == "162c764f-f01d-484d-ad81-1481dc29792a"
    assert main(["derive", "--json", "--at-seq", "16", str(path)]) == 0
    assert json.loads(capsys.readouterr().out) == list(before)


def test_derive_of_a_missing_file_is_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["derive", str(tmp_path / "nope.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "nope.jsonl" in err and "cannot read" in err


def test_empty_log_derives_nothing() -> None:
    assert SessionLog("s").messages() == ()
    assert derive_messages([]) == ()
