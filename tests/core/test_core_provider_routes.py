"""Provider fallback rules (issue 30), as plain data: time is a number, budget waits a dict.

Which failures leave a route, how long a failed route is avoided (a circuit breaker with a
doubling cool-off, never shorter than the provider's Retry-After), which route a call takes
(the first available one within the wait bound, else the least wait, else the one back
soonest), the configuration's errors naming the bad entry, and the rate budget's answer to
"how long would a call asked now wait"."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pipeline.core.errors import ConfigError
from pipeline.core.provider_routes import (
    FailoverPolicy,
    Fallbacks,
    Route,
    RouteChoice,
    RouteHealth,
    choose_route,
    leaves_route,
    logged_route,
    parse_fallbacks,
    route_event_data,
    routed_header,
)
from pipeline.core.rate_budget import Limit, RateBudget, Ticket

PRIMARY, BACKUP, SPARE = Route("deepseek", "deepseek-chat"), Route("backup", "gpt-4o-mini"), \
    Route("spare", "m/with/slashes")
CHAIN = (PRIMARY, BACKUP, SPARE)
POLICY = FailoverPolicy(max_wait_s=10.0, cool_off_s=30.0, max_cool_off_s=100.0)


def waits(**by_provider: float) -> Callable[[Route], float]:
    return lambda route: by_provider.get(route.provider, 0.0)


# -- leaving a route -------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["SERVER", "OVERLOADED", "NETWORK", "TIMEOUT", "RATE_LIMIT",
                                  "QUOTA"])
def test_a_provider_side_failure_leaves_the_route_once_retries_are_spent(code: str) -> None:
    assert not leaves_route(code, None, will_retry=True, policy=POLICY)
    assert leaves_route(code, None, will_retry=False, policy=POLICY)


@pytest.mark.parametrize("code", ["AUTH", "BAD_REQUEST", "CONTEXT_WINDOW_EXCEEDED",
                                  "PROTOCOL", "INVALID_RESPONSE", "CONFIG"])
def test_a_request_the_provider_refuses_as_bad_never_fails_over(code: str) -> None:
    assert not leaves_route(code, None, will_retry=False, policy=POLICY)
    assert not leaves_route(code, 60_000, will_retry=False, policy=POLICY)


def test_a_retry_after_longer_than_the_wait_bound_leaves_at_once() -> None:
    assert leaves_route("RATE_LIMIT", 10_001, will_retry=True, policy=POLICY)
    assert not leaves_route("RATE_LIMIT", 10_000, will_retry=True, policy=POLICY)


# -- the circuit breaker ---------------------------------------------------------------------


def test_a_failed_route_is_avoided_for_a_doubling_cool_off_up_to_the_cap() -> None:
    health = RouteHealth(POLICY)
    assert health.failed(PRIMARY, 1000.0) == 1030.0
    assert health.avoided(PRIMARY, 1029.9) and not health.avoided(PRIMARY, 1030.0)
    assert health.failed(PRIMARY, 1030.0) == 1090.0       # second failure in a row: 60 s
    assert health.failed(PRIMARY, 1090.0) == 1190.0       # 120 s, capped at 100 s
    health.answered(PRIMARY)
    assert not health.avoided(PRIMARY, 1090.0)
    assert health.failed(PRIMARY, 2000.0) == 2030.0       # an answer forgot the failures


def test_a_longer_retry_after_than_the_cool_off_is_honoured() -> None:
    health = RouteHealth(POLICY)
    assert health.failed(BACKUP, 0.0, retry_after_s=300.0) == 300.0
    assert health.failed(SPARE, 0.0, retry_after_s=5.0) == 30.0


# -- choosing --------------------------------------------------------------------------------


def test_the_primary_is_taken_when_it_is_healthy_and_within_the_bound() -> None:
    health = RouteHealth(POLICY)
    assert choose_route(CHAIN, health, 0.0, waits(deepseek=10.0)) == RouteChoice(PRIMARY,
                                                                                 "primary")


def test_a_primary_over_budget_gives_the_first_fallback_within_the_bound() -> None:
    health = RouteHealth(POLICY)
    choice = choose_route(CHAIN, health, 0.0, waits(deepseek=10.5, backup=20.0))
    assert choice == RouteChoice(SPARE, "over-budget")


def test_a_failed_primary_gives_the_fallback_until_its_cool_off_ends() -> None:
    health = RouteHealth(POLICY)
    health.failed(PRIMARY, 0.0)
    assert choose_route(CHAIN, health, 29.0, waits()) == RouteChoice(BACKUP, "failed")
    assert choose_route(CHAIN, health, 30.0, waits()) == RouteChoice(PRIMARY, "primary")


def test_when_every_available_route_waits_too_long_the_shortest_wait_wins() -> None:
    health = RouteHealth(POLICY)
    choice = choose_route(CHAIN, health, 0.0, waits(deepseek=50.0, backup=12.0, spare=12.0))
    assert choice == RouteChoice(BACKUP, "over-budget")   # ties go in chain order


def test_when_every_route_is_avoided_the_one_back_soonest_is_tried() -> None:
    health = RouteHealth(POLICY)
    health.failed(PRIMARY, 10.0)
    health.failed(BACKUP, 0.0)
    health.failed(SPARE, 20.0)
    assert choose_route(CHAIN, health, 21.0, waits()) == RouteChoice(BACKUP, "failed")


def test_the_failing_route_is_excluded_when_looking_for_where_to_go() -> None:
    health = RouteHealth(POLICY)
    health.failed(BACKUP, 0.0)
    assert choose_route(CHAIN, health, 1.0, waits(), exclude=BACKUP) == RouteChoice(
        PRIMARY, "primary")
    assert choose_route((PRIMARY,), health, 1.0, waits(), exclude=PRIMARY) is None


def test_budget_waits_are_asked_only_for_routes_that_might_be_taken() -> None:
    asked: list[Route] = []

    def wait(route: Route) -> float:
        asked.append(route)
        return 0.0
    choose_route(CHAIN, RouteHealth(POLICY), 0.0, wait)
    assert asked == [PRIMARY]


# -- the configuration -----------------------------------------------------------------------


def test_fallbacks_parse_with_their_policy_and_model_names_may_hold_slashes() -> None:
    fallbacks = parse_fallbacks({"deepseek/deepseek-chat": ["backup/gpt-4o-mini",
                                                            "spare/m/with/slashes"],
                                 "policy": {"max_wait_s": 5, "cool_off_s": 60}},
                                known_providers={"deepseek", "backup", "spare"})
    assert fallbacks.chain(PRIMARY) == CHAIN
    assert fallbacks.chain(BACKUP) == (BACKUP,)
    assert fallbacks.policy == FailoverPolicy(max_wait_s=5.0, cool_off_s=60.0)


@pytest.mark.parametrize(("raw", "names"), [
    ([], "must be a JSON object"),
    ({"deepseek": ["backup/x"]}, "key 'deepseek'"),
    ({"deepseek/x": "backup/y"}, "DSH_PROVIDER_FALLBACKS['deepseek/x'] must be a non-empty"),
    ({"deepseek/x": []}, "DSH_PROVIDER_FALLBACKS['deepseek/x'] must be a non-empty"),
    ({"deepseek/x": ["backup/y", "nope"]}, "DSH_PROVIDER_FALLBACKS['deepseek/x'][1]"),
    ({"deepseek/x": ["deepseek/x"]}, "must not repeat a route or name the model itself"),
    ({"deepseek/x": ["backup/y", "backup/y"]}, "must not repeat"),
    ({"deepseek/x": ["typo/y"]}, "unknown provider(s) 'typo'"),
    ({"policy": {"cool_off_s": -1}}, '["policy"].cool_off_s must be a number'),
    ({"policy": {"cool_off_s": 10, "max_cool_off_s": 5}}, '["policy"]: provider fallback'),
    ({"policy": {"patience": 3}}, '["policy"] must be an object of'),
])
def test_a_wrong_entry_is_named(raw: object, names: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_fallbacks(raw, known_providers={"deepseek", "backup"})
    assert names in str(caught.value)


# -- the log ---------------------------------------------------------------------------------


def test_a_route_event_reads_back_and_foreign_data_is_not_trusted() -> None:
    data = route_event_data(BACKUP, PRIMARY, "failed")
    assert data == {"provider": "backup", "model": "gpt-4o-mini", "reason": "failed",
                    "primary": {"provider": "deepseek", "model": "deepseek-chat"}}
    found = logged_route(data)
    assert found is not None and found.route == BACKUP and found.primary == PRIMARY
    assert found.is_fallback and logged_route(found.to_json()) == found
    assert logged_route({"provider": "backup", "model": "x"}) is None
    assert logged_route("backup/x") is None


def test_a_routed_header_differs_from_its_configuration_in_provider_and_model_only() -> None:
    header = {"config": {"provider": "deepseek", "model": "deepseek-chat", "maxTokens": 9},
              "system": "be brief"}
    assert routed_header(header, BACKUP) == {
        "config": {"provider": "backup", "model": "gpt-4o-mini", "maxTokens": 9},
        "system": "be brief"}
    assert header["config"]["provider"] == "deepseek"  # type: ignore[index]


def test_fallbacks_name_every_provider_they_use() -> None:
    assert Fallbacks({PRIMARY: (BACKUP,)}).providers() == {"deepseek", "backup"}


# -- "how long would a call asked now wait" --------------------------------------------------


def test_the_budget_estimates_the_wait_of_a_call_behind_the_queue() -> None:
    budget = RateBudget(Limit(requests_per_minute=60 / 0.95), 0.0)  # 60 a minute granted
    assert budget.wait_estimate(10, 0.0) == 0.0
    for n in range(60):
        budget.enqueue(Ticket("", f"s{n}", 10))
        granted, _ = budget.next_grant(0.0)
        assert granted is not None
    assert budget.wait_estimate(10, 0.0) == pytest.approx(1.0)   # one a second
    budget.enqueue(Ticket("", "queued", 10))
    budget.enqueue(Ticket("", "queued-2", 10))
    assert budget.wait_estimate(10, 0.0) == pytest.approx(3.0)   # behind the two waiting
    assert budget.waiting == 2                                   # nothing taken or queued


def test_a_retry_after_shows_in_the_estimate() -> None:
    budget = RateBudget(Limit(requests_per_minute=600, tokens_per_minute=10_000), 0.0)
    budget.retry_after(45.0, 0.0)
    assert budget.wait_estimate(10, 0.0) >= 45.0
