"""The synthetic session generator: deterministic, valid, and shaped like the fixtures."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from dsh_dev.synth import iter_synth_events, synth_header, synth_session
from pipeline.codec.sessionfile import read_session_file, write_session_file
from pipeline.core.log import SessionLog
from pipeline.core.repair import repair_closers


def test_same_seed_same_events_other_seed_other_events() -> None:
    first = synth_session(3, 3000)
    assert [e.to_line() for e in first] == [e.to_line() for e in synth_session(3, 3000)]
    assert first != synth_session(4, 3000)
    assert synth_session(3, 100) == first[:100]
    assert synth_session(3, 0) == []


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_synthetic_sessions_are_valid_in_strict_mode(seed: int) -> None:
    events = synth_session(seed, 5000)
    log = SessionLog(f"synth-{seed}", mode="strict")
    log.extend(events)
    assert len(log.messages()) > 10
    log.extend(repair_closers(log))  # an open cut is repairable like a crash
    assert log.turn.turn is None


def test_mix_follows_the_fixtures() -> None:
    events = synth_session(11, 20000)
    counts = Counter(e.type for e in events)
    assert 0.75 <= counts["assistant/chunk"] / len(events) <= 0.92
    for rare in ("compaction/start", "llm/retry", "tool/result", "request/header",
                 "session/title", "agent/inbox/spliced"):
        assert counts[rare] > 0, rare
    replaces = [e for e in events if e.surface_op not in (None, "append")]
    interrupted = [e for e in events if e.type == "assistant/message"
                   and e.data.get("interrupted")]
    assert replaces and interrupted
    kinds = Counter(e.data["chunk"]["type"] for e in events if e.type == "assistant/chunk")
    assert kinds["reasoning-delta"] > kinds["text-delta"] > 0 and kinds["tool-call-delta"] > 0


def test_synthetic_session_packs_and_round_trips(tmp_path: Path) -> None:
    events = synth_session(5, 2000)
    path = tmp_path / "synth.jsonl.zstd"
    write_session_file(path, events, header=synth_header(5), packed=True)
    read = read_session_file(path)
    assert read.events == tuple(events) and read.session_id == "synth-5"
    plain = tmp_path / "synth.jsonl"
    write_session_file(plain, events, header=synth_header(5), packed=True)
    assert len(plain.read_text().splitlines()) < len(events) / 3  # runs really packed


def test_stream_is_endless_and_contiguous() -> None:
    stream = iter_synth_events(9)
    seqs = [next(stream).seq for _ in range(1000)]
    assert seqs == list(range(1000))
