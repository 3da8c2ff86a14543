"""The provider rate budget (``core/rate_budget.py``): plain data, time passed in."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cli.provider_config import provider_limits_of
from pipeline.core.errors import ConfigError
from pipeline.core.events import JsonValue, dumps_json
from pipeline.core.rate_budget import (
    HEADROOM,
    Limit,
    RateBudget,
    Ticket,
    estimated_tokens,
    parse_limits,
    text_characters,
)
from pipeline.settings import Settings


def drain(budget: RateBudget, until: float, now: float = 0.0) -> list[tuple[float, Ticket]]:
    """Grant what the budget grants, sleeping as it says, until ``until``."""
    granted = []
    while now <= until:
        ticket, wait = budget.next_grant(now)
        if ticket is not None:
            granted.append((now, ticket))
            continue
        if wait == 0:
            break
        now += wait
    return granted


@settings(max_examples=60, deadline=None)
@given(rpm=st.integers(1, 600), share=st.sampled_from([1.0, 0.5, 0.25]),
       calls=st.integers(1, 400), minutes=st.integers(1, 4))
def test_no_window_grants_more_than_the_limit_after_the_first_minute(
        rpm: int, share: float, calls: int, minutes: int) -> None:
    rpm = max(rpm, math.ceil(1 / (share * HEADROOM)))   # a bucket below one call: wait_s
    budget = RateBudget(Limit(requests_per_minute=rpm), 0.0, share=share)
    for n in range(calls):
        budget.enqueue(Ticket("", f"s{n % 7}", 0))
    granted = drain(budget, 60.0 * minutes)
    allowed = rpm * share * HEADROOM
    # A full bucket at the start, then the refill: never more in total.
    for at, _ in granted:
        assert sum(1 for t, _ in granted if t <= at) <= allowed * (1 + at / 60) + 1e-6
    assert abs(len(granted) - min(calls, int(allowed * (1 + minutes)))) <= 1


def test_a_tenant_at_ten_times_does_not_starve_the_others() -> None:
    budget = RateBudget(Limit(requests_per_minute=60), 0.0)
    for n in range(100):
        budget.enqueue(Ticket("big", f"b{n % 5}", 0))
    for tenant in "abcdefghi":
        for n in range(10):
            budget.enqueue(Ticket(tenant, f"{tenant}{n % 2}", 0))
    granted = [t for _, t in drain(budget, 120.0)]
    first = Counter(t.tenant for t in granted[:100])
    # Ten tenants waiting: each gets a tenth of the grants while all of them wait.
    assert all(first[tenant] == 10 for tenant in "abcdefghi"), first
    assert first["big"] == 10


def test_sessions_of_a_tenant_take_turns_and_keep_their_order() -> None:
    budget = RateBudget(Limit(), 0.0)
    for n in range(3):
        for session in ("x", "y"):
            budget.enqueue(Ticket("t", session, n))
    granted = [(t.session_id, t.tokens) for _, t in drain(budget, 1.0)]
    assert granted == [("x", 0), ("y", 0), ("x", 1), ("y", 1), ("x", 2), ("y", 2)]


def test_weights_give_a_tenant_more_turns_per_round() -> None:
    budget = RateBudget(Limit(), 0.0, weights={"gold": 3})
    for n in range(12):
        budget.enqueue(Ticket("gold", f"g{n}", 0))
        budget.enqueue(Ticket("free", f"f{n}", 0))
    granted = [t.tenant for _, t in drain(budget, 1.0)][:8]
    assert Counter(granted) == {"gold": 6, "free": 2}


def test_a_tenant_over_its_own_limit_waits_while_the_others_are_served() -> None:
    limits = parse_limits({"*": {"requests_per_minute": 600},
                           "tenants": {"capped": {"requests_per_minute": 60},
                                       "gold": {"weight": 2}}})
    assert limits.weights == {"capped": 1, "gold": 2}
    assert limits.tenant_limits == {"capped": Limit(requests_per_minute=60)}
    budget = RateBudget(Limit(requests_per_minute=600), 0.0,
                        tenant_limits=limits.tenant_limits)
    for n in range(200):
        budget.enqueue(Ticket("capped", f"c{n % 4}", 0))
        budget.enqueue(Ticket("free", f"f{n % 4}", 0))
    granted = drain(budget, 60.0)
    capped = [at for at, t in granted if t.tenant == "capped"]
    own = 60 * HEADROOM
    # its own bucket: a minute's worth at once, then its refill, never more
    assert len(capped) <= own * 2 + 1 and len(capped) >= own * 2 - 2
    for at in capped:
        assert sum(1 for t in capped if t <= at) <= own * (1 + at / 60) + 1e-6
    # the other tenant was served meanwhile: everything it asked for fits the budget
    assert sum(1 for _, t in granted if t.tenant == "free") == 200


def test_a_tenants_own_tokens_are_corrected_and_reshared() -> None:
    budget = RateBudget(Limit(), 0.0, tenant_limits={"t": Limit(tokens_per_minute=1000)})
    own = budget.tenant_buckets["t"].tokens
    assert own is not None and own.level == pytest.approx(1000 * HEADROOM)
    budget.enqueue(Ticket("t", "s", 400))
    assert budget.next_grant(0.0)[0] is not None
    budget.settle(400, 100, 0.0, tenant="t")
    assert own.level == pytest.approx(1000 * HEADROOM - 100)
    budget.reshare(0.5, 0.0)
    assert own.per_minute == pytest.approx(500 * HEADROOM)
    assert own.level == pytest.approx((1000 * HEADROOM - 100) / 2)


def test_tokens_are_estimated_then_corrected_from_the_reported_usage() -> None:
    budget = RateBudget(Limit(tokens_per_minute=1_000), 0.0)
    budget.enqueue(Ticket("", "s", 400))
    assert budget.next_grant(0.0)[0] is not None
    budget.settle(estimated=400, reported=900, now=0.0)   # the call used more
    size = 1_000 * HEADROOM
    assert budget.tokens is not None and budget.tokens.level == pytest.approx(size - 900)
    budget.enqueue(Ticket("", "s", 400))
    ticket, wait = budget.next_grant(0.0)
    missing = 400 - (size - 900)
    assert ticket is None and wait == pytest.approx(missing * 60 / size)
    assert budget.next_grant(wait)[0] is not None


def test_the_estimate_counts_the_characters_of_the_strings_four_a_token() -> None:
    message = {"role": "user", "content": [{"type": "text", "text": "héllo wörld"}],
               "n": 12345, "ok": True, "none": None}
    # keys role content type text n ok none (4+7+4+4+1+2+4), values user text héllo wörld
    assert text_characters(message) == 26 + 4 + 4 + 11
    assert text_characters([message, (message,)]) == 2 * text_characters(message)
    assert text_characters(42) == 0 and text_characters("") == 0
    assert estimated_tokens((message,)) == 45 // 4
    assert estimated_tokens((message,), "a system prompt") == (45 + 15) // 4
    assert estimated_tokens(()) == 1 and estimated_tokens((), "") == 1


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=100, deadline=None)
@given(messages=st.lists(JSON_VALUES, max_size=5))
def test_the_estimate_never_exceeds_the_json_bodys_length_over_four(
        messages: list[JsonValue]) -> None:
    """The strings' characters are in the serialised body: the walk's estimate is at most
    what the body's length gave (the punctuation is left out), and at least one token."""
    assert text_characters(messages) <= len(dumps_json(messages))
    assert 1 <= estimated_tokens(messages) <= max(1, len(dumps_json(messages)) // 4)


def test_retry_after_and_the_reported_remaining_narrow_the_budget_at_once() -> None:
    budget = RateBudget(Limit(requests_per_minute=600, tokens_per_minute=60_000), 0.0,
                        share=0.5)
    budget.retry_after(7.0, now=1.0)
    budget.enqueue(Ticket("", "s", 10))
    ticket, wait = budget.next_grant(1.0)
    # Blocked 7 s, then empty: one request's refill (~0.2 s at 300 a minute) more.
    refill_one = 60 / (300 * HEADROOM)
    assert ticket is None and wait == pytest.approx(7.0 + refill_one)
    assert budget.next_grant(7.9)[0] is None
    assert budget.next_grant(8.0 + refill_one)[0] is not None
    # The provider counts the fleet's calls: 4 left for all of it is 2 for this share.
    budget.provider_remaining(requests=4, tokens=None, now=10.0)
    for _ in range(3):
        budget.enqueue(Ticket("", "s", 1))
    assert [t is not None for t, _ in (budget.next_grant(10.0) for _ in range(3))] == [
        True, True, False]
    # The provider refills on, and so does the bucket: the next call waits for one
    # request's refill, not for the provider's "reset" (when its bucket is full again).
    ticket, wait = budget.next_grant(10.0)
    assert ticket is None and wait == pytest.approx(refill_one)
    assert budget.next_grant(10.0 + refill_one)[0] is not None


def test_a_new_share_takes_effect_without_granting_twice() -> None:
    budget = RateBudget(Limit(requests_per_minute=60), 0.0, share=1.0)
    for _ in range(200):
        budget.enqueue(Ticket("", "s", 0))
    assert len(drain(budget, 0.0)) == int(60 * HEADROOM)   # the full bucket at once
    budget.reshare(0.5, now=0.0)                  # two drivers now: half the refill
    later = drain(budget, 60.0)
    assert len(later) == int(30 * HEADROOM)
    with pytest.raises(ConfigError, match="share"):
        budget.reshare(0.0, now=0.0)


def test_a_cancelled_call_leaves_the_queue_and_limits_must_be_positive() -> None:
    budget = RateBudget(Limit(requests_per_minute=1), 0.0)
    first, second = budget.enqueue(Ticket("a", "s", 0)), budget.enqueue(Ticket("a", "s", 0))
    budget.cancel(first)
    assert budget.waiting == 1 and budget.next_grant(0.0)[0] is second
    with pytest.raises(ConfigError, match="requests_per_minute must be > 0"):
        Limit(requests_per_minute=0)


def test_limits_parse_with_defaults_and_say_what_is_wrong() -> None:
    limits = parse_limits({"deepseek/deepseek-chat": {"requests_per_minute": 500},
                           "deepseek/*": {"tokens_per_minute": 1e6}, "*": {},
                           "tenants": {"acme": {"weight": 3}}})
    assert limits.limit_of("deepseek", "deepseek-chat") == Limit(requests_per_minute=500)
    assert limits.limit_of("deepseek", "reasoner") == Limit(tokens_per_minute=1e6)
    assert limits.limit_of("openai", "gpt") == Limit()
    assert parse_limits({}).limit_of("openai", "gpt") is None
    assert limits.weights == {"acme": 3}
    for raw, message in (([], "must be a JSON object"),
                         ({"deepseek": {"requests_per_minute": 1}}, "must be provider/model"),
                         ({"a/b": {"rpm": 1}}, "requests_per_minute and/or"),
                         ({"a/b": {"requests_per_minute": "9"}}, "must be a number"),
                         ({"a/b": {"requests_per_minute": -1}}, "must be > 0"),
                         ({"tenants": {"x": {"weight": 0}}}, "integer >= 1"),
                         ({"tenants": {"x": {}}}, "must be an object of weight"),
                         ({"tenants": {"a/b": {"weight": 1}}}, "not a valid name"),
                         ({"tenants": {"x": {"tokens_per_minute": "many"}}},
                          r"\['x'\]\.tokens_per_minute must be a number")):
        with pytest.raises(ConfigError, match=message):
            parse_limits(raw)


def test_the_driver_reads_limits_from_json_or_a_file(tmp_path: Path) -> None:
    text = '{"deepseek/*": {"requests_per_minute": 60}}'
    path = tmp_path / "limits.json"
    path.write_text(text)
    for value in (text, str(path)):
        limits = provider_limits_of(Settings(provider_limits=value))
        assert limits is not None and limits.limit_of("deepseek", "x") == Limit(60)
    assert provider_limits_of(Settings()) is None
    with pytest.raises(ConfigError, match="cannot be read"):
        provider_limits_of(Settings(provider_limits=str(tmp_path / "missing.json")))
    with pytest.raises(ConfigError, match="is not JSON"):
        provider_limits_of(Settings(provider_limits="{nope"))
