"""Usage samples, totals, OTel conversion and tumbling windows closed by ticks."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_paths import SHARED_DIR

from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import EventError
from pipeline.core.events import Event
from pipeline.core.usage import (
    SessionUsage,
    TokenCounts,
    UsageSample,
    UsageScan,
    WindowBook,
    window_record,
)

FIXTURES = (SHARED_DIR / "fixtures/dsh-format0")


def assistant(seq: int, usage: dict[str, int] | None, source: dict[str, Any] | None = None,
              time: int = 0) -> Event:
    message: dict[str, Any] = {"role": "assistant", "content": [{"type": "text", "text": "x"}]}
    if source is not None:
        message["source"] = source
    data: dict[str, Any] = {"turn": 1, "step": 1, "message": message}
    if usage is not None:
        data["usage"] = usage
    return Event("assistant/message", seq, time, data, "append", ())


def header(seq: int, provider: str, model: str) -> Event:
    return Event("request/header", seq, 0,
                 {"header": {"config": {"provider": provider, "model": model}},
                  "reason": "initial"})


def test_otel_input_includes_cached_input_and_dsh_counts_stay_disjoint() -> None:
    counts = TokenCounts.from_dsh({"inputTokens": 100, "outputTokens": 30, "cacheReadTokens": 50,
                                   "cacheWriteTokens": 7, "reasoningTokens": 20})
    attrs = counts.otel_attributes()
    assert attrs["gen_ai.usage.input_tokens"] == 157
    assert attrs["gen_ai.usage.output_tokens"] == 30
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 50
    assert attrs["gen_ai.usage.cache_creation.input_tokens"] == 7
    assert attrs["dsh.usage.input_tokens"] == 100
    assert attrs["dsh.usage.reasoning_tokens"] == 20


def test_bad_usage_is_refused_naming_the_field_and_seq() -> None:
    with pytest.raises(EventError, match=r"seq 4.*usage.outputTokens must be a non-negative"):
        TokenCounts.from_dsh({"inputTokens": 1, "outputTokens": -1}, seq=4)


def test_model_comes_from_the_message_source_else_the_last_request_header() -> None:
    state = SessionUsage()
    assert state.apply("s", assistant(0, {"inputTokens": 1, "outputTokens": 1})).model == "unknown"
    state.apply("s", header(1, "deepseek", "v4"))
    sample = state.apply("s", assistant(2, {"inputTokens": 2, "outputTokens": 1}))
    assert sample is not None and sample.model_key == "deepseek/v4"
    sourced = state.apply("s", assistant(3, {"inputTokens": 3, "outputTokens": 1},
                                         {"kind": "model", "provider": "p", "model": "m"}))
    assert sourced is not None and sourced.model_key == "p/m"
    assert state.apply("s", assistant(4, None)) is None
    assert state.totals.input_tokens == 6 and state.totals.calls == 3
    assert SessionUsage.from_json(state.to_json()) == state


def test_fixture_usage_counts_each_call_once_not_the_usage_chunk_too() -> None:
    scan = UsageScan()
    scan.add_log("t", read_session_file(FIXTURES / "text-turn.jsonl").events)
    totals = scan.by_session["t"]
    assert (totals.input_tokens, totals.output_tokens, totals.calls) == (3091, 23, 1)
    assert scan.by_model == {"deepseek-official/deepseek-v4-flash": totals}


def sample(time: int, seq: int = 0, tokens: int = 1) -> UsageSample:
    return UsageSample("s", seq, time, "p", "m", TokenCounts(tokens, 0, 0, 0, 0, 1))


def test_window_closes_on_a_tick_after_end_plus_grace_and_late_samples_are_reported() -> None:
    book = WindowBook(grace_ms=500, sizes={"minute": 1000})
    assert book.windows_for(sample(1200)) == (["window/minute/1000/p/m"], [])
    assert book.tick(2400) == []                       # end 2000 + grace 500 not reached
    assert book.windows_for(sample(1900)) == (["window/minute/1000/p/m"], [])  # within grace
    closed = book.tick(2500)
    assert [key for key, _ in closed] == ["window/minute/1000/p/m"]
    record = window_record(closed[0][1], TokenCounts(3, 0, 0, 0, 0, 2), closed=True)
    assert record["startMs"] == 1000 and record["endMs"] == 2000 and record["closed"] is True
    assert book.windows_for(sample(1999)) == ([], ["window/minute/1000/p/m"])  # too late
    assert book.tick(100) == [] and book.last_tick_ms == 2500                 # never backwards


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 50), st.booleans()),
                max_size=60))
def test_windows_plus_late_samples_account_for_every_token(
        steps: list[tuple[int, int, bool]]) -> None:
    book = WindowBook(grace_ms=300, sizes={"a": 1000, "b": 3000})
    windows: dict[str, int] = {}
    late = {"a": 0, "b": 0}
    now = 0
    for time, tokens, tick in steps:
        if tick:
            now += 700
            book.tick(now)
        accepted, late_keys = book.windows_for(sample(time, tokens=tokens))
        for key in accepted:
            windows[key] = windows.get(key, 0) + tokens
        for key in late_keys:
            late[key.split("/")[1]] += tokens
    total = sum(tokens for _t, tokens, _k in steps)
    for gran in ("a", "b"):
        in_windows = sum(v for k, v in windows.items() if k.split("/")[1] == gran)
        assert in_windows + late[gran] == total
