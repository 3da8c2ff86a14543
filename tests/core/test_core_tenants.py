"""Tenant names, the tenant event and the rule that a session never changes tenant."""

from __future__ import annotations

import pytest

from pipeline.core.errors import ConfigError
from pipeline.core.events import Event
from pipeline.core.tenants import (
    TENANT_TYPE,
    checked_tenant,
    command_tenant_error,
    tenant_event_data,
    tenant_of,
    tenant_of_events,
)


@pytest.mark.parametrize("name", ["", "acme", "a", "Team_2.eu-west", "x" * 64])
def test_valid_names_are_kept(name: str) -> None:
    assert checked_tenant(name) == name


@pytest.mark.parametrize("name", ["a/b", "with space", "x" * 65, "tab\t", "é"])
def test_invalid_names_are_refused_with_the_rule(name: str) -> None:
    with pytest.raises(ConfigError, match="1 to 64 characters"):
        checked_tenant(name)


def test_the_event_data_round_trips() -> None:
    data = tenant_event_data("acme", "m-1")
    assert data == {"tenant": "acme", "messageId": "m-1"}
    assert tenant_of(data) == "acme"
    with pytest.raises(ConfigError):
        tenant_event_data("a/b", "m-1")


@pytest.mark.parametrize("data", [None, "acme", {"tenant": 3}, {"tenant": "a/b"},
                                  {"tenant": ""}, {}])
def test_data_that_does_not_fit_names_no_tenant(data: object) -> None:
    assert tenant_of(data) is None


def _event(seq: int, type_: str, data: object) -> Event:
    return Event(type=type_, seq=seq, time=seq, data=data, ignorable=True)


def test_the_first_valid_tenant_event_wins() -> None:
    events = [_event(0, TENANT_TYPE, {"tenant": "a/b"}),
              _event(1, TENANT_TYPE, {"tenant": "acme", "messageId": "m"}),
              _event(2, TENANT_TYPE, {"tenant": "other", "messageId": "n"})]
    assert tenant_of_events(events) == "acme"
    assert tenant_of_events([_event(0, "user/message", {})]) == ""


def test_a_command_cannot_move_a_session_to_another_tenant() -> None:
    assert command_tenant_error("acme", None, "s") is None
    assert command_tenant_error("acme", "acme", "s") is None
    moved = command_tenant_error("acme", "globex", "s")
    assert moved is not None and "'acme'" in moved and "'globex'" in moved
    from_default = command_tenant_error("", "globex", "s")
    assert from_default is not None and "the default tenant" in from_default
