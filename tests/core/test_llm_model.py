"""pipeline.core.model: assembling chunks (checked against the recorded fixtures), retries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from shared_paths import SHARED_DIR

from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import ProviderError, TurnError
from pipeline.core.model import (
    ModelRequest,
    RetryPolicy,
    StreamAccumulator,
    aborted_finish,
    assemble,
    block_end,
    block_start,
    error_finish,
    failure_of,
    finish_chunk,
    make_usage,
    text_delta,
    tool_call_delta,
    tool_calls_of,
)

FIXTURES = (SHARED_DIR / "fixtures/dsh-format0")
LOGS = sorted(FIXTURES.glob("*.jsonl"))


def fixture_attempts(path: Path) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """(chunks named by its sourceEventSeqs, data) of every assistant/message of a log."""
    events = read_session_file(path).events
    chunk_by_seq = {e.seq: e.data["chunk"] for e in events if e.type == "assistant/chunk"}
    return [([chunk_by_seq[s] for s in e.source_event_seqs or ()], e.data)
            for e in events if e.type == "assistant/message"]


def test_fixtures_are_there() -> None:
    assert len(LOGS) == 5
    assert sum(len(fixture_attempts(p)) for p in LOGS) >= 7


@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_assembling_fixture_chunks_gives_the_logged_message(path: Path) -> None:
    for chunks, data in fixture_attempts(path):
        if not chunks:
            continue  # a message written without chunks (crash-repair fixture)
        acc = StreamAccumulator()
        for chunk in chunks:
            acc.add(chunk)
        expected = data["message"]["content"]
        if data.get("interrupted"):
            assert acc.finish is None
            assert acc.partial_content() == expected
        else:
            assert assemble(chunks) == expected
            assert acc.content() == expected
            assert acc.finish_kind in {"stop", "tool-calls"}
            assert acc.usage == data.get("usage")


def test_partial_content_keeps_ended_blocks_and_visible_text_only() -> None:
    acc = StreamAccumulator()
    for chunk in [block_start(0, "reasoning"), {"type": "reasoning-delta", "index": 0,
                                                "text": "hm"},
                  block_end(0, {"type": "reasoning", "text": "hm"}),
                  block_start(1, "text"), text_delta(1, "Hel"), text_delta(1, "lo"),
                  block_start(2, "tool-call"), tool_call_delta(2, "c1", '{"a":', name="f")]:
        acc.add(chunk)
    assert acc.content() == [{"type": "reasoning", "text": "hm"}]
    # the unfinished tool call is dropped: it could never be answered
    assert acc.partial_content() == [{"type": "reasoning", "text": "hm"},
                                     {"type": "text", "text": "Hello"}]
    assert acc.chunk_count == 8


def test_content_is_in_index_order_whatever_the_block_end_order() -> None:
    chunks = [block_start(0, "text"), block_start(1, "tool-call"),
              block_end(1, {"type": "tool-call", "id": "c", "name": "f", "arguments": "{}"}),
              block_end(0, {"type": "text", "text": "x"}), finish_chunk("tool-calls")]
    content = assemble(chunks)
    assert [b["type"] for b in content] == ["text", "tool-call"]
    assert tool_calls_of(content) == [content[1]]


def test_failure_and_finish_builders() -> None:
    error = ProviderError("slow down", code="RATE_LIMIT", status=429, retry_after_ms=1500,
                          request_id="req-1")
    assert failure_of(error) == {"message": "slow down", "code": "RATE_LIMIT", "status": 429,
                                 "providerRetryAfterMs": 1500, "requestId": "req-1"}
    assert error_finish(ProviderError("x", code="NETWORK")) == {
        "type": "finish", "reason": {"kind": "error",
                                     "failure": {"message": "x", "code": "NETWORK"}}}
    assert aborted_finish()["reason"]["kind"] == "aborted"
    with pytest.raises(TurnError, match="error_finish"):
        finish_chunk("error")
    assert list(make_usage(input_tokens=1, output_tokens=2, reasoning_tokens=1)) == [
        "inputTokens", "outputTokens", "reasoningTokens"]


def test_model_request_refuses_bad_fields() -> None:
    ok = ModelRequest(provider="deepseek", model="m", messages=())
    assert ok == ModelRequest(provider="deepseek", model="m", messages=())
    with pytest.raises(TurnError, match="model"):
        ModelRequest(provider="deepseek", model="", messages=())
    with pytest.raises(TurnError, match="tuple"):
        ModelRequest(provider="deepseek", model="m", messages=[])  # type: ignore[arg-type]
    with pytest.raises(TurnError, match="max_tokens"):
        ModelRequest(provider="deepseek", model="m", messages=(), max_tokens=0)


# --------------------------------------------------------------------------- retries

def _err(code: str, retry_after_ms: int | None = None) -> ProviderError:
    return ProviderError("e", code=code, retry_after_ms=retry_after_ms)


def test_retry_backoff_grows_to_the_ceiling_with_equal_jitter() -> None:
    policy = RetryPolicy(max_attempts=10, base_ms=100, max_ms=1000)
    server = _err("SERVER")
    assert [policy.delay_ms(a, server, 1.0) for a in range(1, 7)] == [
        100, 200, 400, 800, 1000, 1000]
    assert [policy.delay_ms(a, server, 0.0) for a in range(1, 5)] == [50, 100, 200, 400]
    assert policy.delay_ms(3, server, 0.5) == 300
    assert policy.delay_ms(10_000, server, 1.0) == 1000  # no overflow on huge attempts


def test_retry_after_is_a_floor_and_a_too_long_one_gives_up() -> None:
    policy = RetryPolicy(max_attempts=5, base_ms=100, max_ms=1000, max_retry_after_ms=60_000)
    assert policy.delay_ms(1, _err("RATE_LIMIT", 7000), 0.0) == 7000
    assert policy.delay_ms(4, _err("RATE_LIMIT", 10), 1.0) == 800
    assert policy.should_retry(1, _err("RATE_LIMIT", 60_000))
    assert not policy.should_retry(1, _err("RATE_LIMIT", 60_001))


def test_which_errors_and_attempts_are_retried() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert policy.should_retry(1, _err("SERVER"))
    assert policy.should_retry(2, _err("OVERLOADED"))
    assert not policy.should_retry(3, _err("SERVER"))  # three attempts made
    for code in ("AUTH", "BAD_REQUEST", "CONTEXT_WINDOW_EXCEEDED", "PROTOCOL"):
        assert not policy.should_retry(1, _err(code))
    custom = RetryPolicy(retriable_codes=frozenset({"PROTOCOL"}))
    assert custom.should_retry(1, _err("PROTOCOL"))
    assert not custom.should_retry(1, _err("SERVER"))


def test_retry_policy_refuses_bad_arguments() -> None:
    with pytest.raises(TurnError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(TurnError):
        RetryPolicy(base_ms=10, max_ms=5)
    with pytest.raises(TurnError, match="jitter"):
        RetryPolicy().delay_ms(1, _err("SERVER"), 1.5)
    with pytest.raises(TurnError, match="start at 1"):
        RetryPolicy().should_retry(0, _err("SERVER"))
