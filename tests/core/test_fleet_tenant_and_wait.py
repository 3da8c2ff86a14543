"""The fleet row carries the session's tenant and shows a step waiting for a provider's
budget, from the log alone (pipeline.core.fleet)."""

from __future__ import annotations

from pipeline.core.events import Event, JsonValue
from pipeline.core.fleet import FleetStatus
from pipeline.core.rate_budget import PROVIDER_GRANTED_TYPE, PROVIDER_WAIT_TYPE
from pipeline.core.tenants import TENANT_TYPE

WHICH: dict[str, JsonValue] = {"provider": "deepseek", "model": "deepseek-chat"}


def _folded(*events: tuple[str, JsonValue]) -> FleetStatus:
    status = FleetStatus("s1")
    for seq, (type_, data) in enumerate(events):
        status.apply(Event(type_, seq, 1000 * (seq + 1), data,
                           ignorable=True if type_.startswith("dsh-pipeline/") else None))
    return status


def test_the_first_valid_tenant_event_names_the_rows_tenant() -> None:
    assert _folded().tenant == ""
    assert _folded((TENANT_TYPE, {"tenant": "a/b"}), (TENANT_TYPE, {"tenant": "acme"}),
                   (TENANT_TYPE, {"tenant": "globex"})).tenant == "acme"


def test_a_wait_shows_until_its_grant() -> None:
    start = [("turn/start", {"turn": 1}), ("step/start", {"turn": 1, "step": 1}),
             (PROVIDER_WAIT_TYPE, WHICH)]
    waiting = _folded(*start)
    assert (waiting.provider_wait, waiting.provider_wait_since_ms) == (
        "deepseek/deepseek-chat", 3000)
    granted = _folded(*start, (PROVIDER_GRANTED_TYPE, {**WHICH, "waitedMs": 1500}))
    assert (granted.provider_wait, granted.provider_wait_since_ms) == (None, None)


def test_a_step_or_turn_that_ends_waits_for_nothing() -> None:
    start = [("turn/start", {"turn": 1}), ("step/start", {"turn": 1, "step": 1}),
             (PROVIDER_WAIT_TYPE, WHICH)]
    for closer in (("step/end", {"turn": 1, "step": 1}),
                   ("turn/end", {"turn": 1, "reason": {"kind": "aborted"}})):
        assert _folded(*start, closer).provider_wait is None


def test_the_row_round_trips_through_json() -> None:
    status = _folded((TENANT_TYPE, {"tenant": "acme"}), (PROVIDER_WAIT_TYPE, WHICH))
    assert FleetStatus.from_json(status.to_json()) == status
    old_row = {k: v for k, v in FleetStatus("s1").to_json().items()
               if k not in ("tenant", "provider_wait", "provider_wait_since_ms")}
    assert FleetStatus.from_json(old_row).tenant == ""  # a row persisted before tenants
