"""Tenants on the real broker: the first command puts a session in its tenant (the field or a
service's ``dsh.tenant`` header), and a command of another tenant goes to the dead letters
with the reason while the session runs on (pipeline.core.tenants)."""

from __future__ import annotations

import uuid

import pytest
from test_driver_kafka import (
    completed_turns,
    read_all,
    running,
    strict_log,
    wait_for_events,
)

from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord, header_value
from pipeline.codec.inbox import InboxCodec
from pipeline.codec.records import HEADER_TENANT
from pipeline.core.inbox import FollowUp
from pipeline.settings import Settings

pytestmark = [pytest.mark.broker, pytest.mark.timeout(300)]


def _followup(settings: Settings, session: str, tenant: str | None = None,
              header: str | None = None) -> OutRecord:
    command = FollowUp(session, str(uuid.uuid4()), ({"type": "text", "text": "hi"},),
                       tenant=tenant)
    headers = ((HEADER_TENANT, header.encode()),) if header is not None else ()
    return OutRecord(settings.topics.inbox, session.encode(), InboxCodec().encode(command),
                     headers)


async def test_tenants_are_set_first_kept_and_never_crossed(topics: Settings,
                                                            group_id: str) -> None:
    acme, beta = "s-tenant-acme", "s-tenant-header"
    async with running(topics, group_id) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        await send_records(topics, [_followup(topics, acme, tenant="acme"),
                                    _followup(topics, beta, header="beta")])
        await wait_for_events(topics, acme, lambda ev: completed_turns(ev) == 1)
        await send_records(topics, [_followup(topics, acme, tenant="globex")])
        await send_records(topics, [_followup(topics, acme)])  # not stated: the session's
        events = await wait_for_events(topics, acme, lambda ev: completed_turns(ev) == 2)
        beta_events = await wait_for_events(topics, beta, lambda ev: completed_turns(ev) == 1)
    strict_log(acme, events)
    assert (events[0].type, events[0].data["tenant"]) == ("dsh-pipeline/tenant", "acme")
    assert [e.seq for e in events if e.type == "dsh-pipeline/tenant"] == [0]
    assert (beta_events[0].type, beta_events[0].data["tenant"]) == ("dsh-pipeline/tenant", "beta")
    letters = await read_all(topics, topics.topics.dlq(topics.topics.inbox))
    assert len(letters) == 1 and letters[0][0] == acme.encode()
    reason = header_value(letters[0][2], "dsh.error.message") or b""
    assert b"belongs to tenant 'acme', not to tenant 'globex'" in reason
    assert driver.service.metrics.dead_letters == 1
