"""A session's tenant: set by its first command, logged first, kept by rebuilds and
checkpoints, never changed by a later command (pipeline.core.tenants)."""

from __future__ import annotations

import io
import json

import fastavro
import pytest
from test_turn_machine_harness import new_machine

from pipeline.codec.inbox import SCHEMA_DIR, InboxCodec, schema_fingerprint
from pipeline.codec.schemas import SINGLE_OBJECT_MAGIC
from pipeline.core.checkpoint import SessionCheckpoint
from pipeline.core.errors import EventError, TurnError
from pipeline.core.inbox import Approve, Cancel, Configure, FollowUp, command_from_json
from pipeline.core.log import SessionLog
from pipeline.core.tenants import TENANT_TYPE
from pipeline.core.turn_history import History, scan_history

TEXT = ({"type": "text", "text": "hi"},)


@pytest.mark.parametrize("command", [
    FollowUp("s1", "m1", TEXT, tenant="acme"), Cancel("s1", "c1", tenant=""),
    Configure("s1", "c2", model="m", tenant="acme"), Approve("s1", "a1", "call", tenant="t.1"),
])
def test_the_tenant_travels_in_json_and_avro(command: object) -> None:
    codec = InboxCodec()
    assert codec.decode(codec.encode(command)) == command  # type: ignore[arg-type]


def test_a_v2_record_without_tenant_decodes_as_not_stated() -> None:
    v2 = json.loads((SCHEMA_DIR / "history/dsh.InboxCommand.v2.avsc").read_text())
    record = {f["name"]: None for f in v2["fields"]}
    record.update(kind="followup", sessionId="s1", messageId="m1",
                  content='[{"type":"text","text":"hi"}]')
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(v2), record)
    decoded = InboxCodec().decode(SINGLE_OBJECT_MAGIC + schema_fingerprint(v2) + body.getvalue())
    assert decoded == FollowUp("s1", "m1", TEXT) and decoded.tenant is None


@pytest.mark.parametrize("tenant", ["a/b", 7, "x" * 65])
def test_a_bad_tenant_is_refused_naming_the_rule(tenant: object) -> None:
    with pytest.raises(EventError, match="tenant"):
        command_from_json({"kind": "followup", "sessionId": "s1", "messageId": "m",
                           "content": list(TEXT), "tenant": tenant})


def test_the_first_command_logs_the_tenant_before_anything_else() -> None:
    machine = new_machine()
    machine.submit(FollowUp("s1", "m1", TEXT, tenant="acme"), 5)
    first, *rest = machine.take_events()
    assert (first.seq, first.type, first.ignorable) == (0, TENANT_TYPE, True)
    assert first.data == {"tenant": "acme", "messageId": "m1"}
    assert rest and rest[0].type == "agent/inbox/spliced"
    assert machine.tenant == "acme"


def test_the_default_tenant_writes_no_event() -> None:
    for tenant in (None, ""):
        machine = new_machine()
        machine.submit(FollowUp("s1", "m1", TEXT, tenant=tenant), 5)
        assert TENANT_TYPE not in [e.type for e in machine.take_events()]
        assert machine.tenant == ""


def test_a_later_command_of_another_tenant_is_refused_and_changes_nothing() -> None:
    machine = new_machine()
    machine.submit(FollowUp("s1", "m1", TEXT, tenant="acme"), 5)
    machine.take_events()
    with pytest.raises(TurnError, match="belongs to tenant 'acme', not to tenant 'globex'"):
        machine.submit(FollowUp("s1", "m2", TEXT, tenant="globex"), 6)
    assert machine.take_events() == [] and machine.tenant == "acme"
    machine.submit(FollowUp("s1", "m3", TEXT), 7)  # not stated: the session's own
    machine.submit(FollowUp("s1", "m4", TEXT, tenant="acme"), 8)
    assert len(machine.take_events()) == 2


def test_a_session_of_the_default_tenant_cannot_be_claimed_later() -> None:
    machine = new_machine()
    machine.submit(FollowUp("s1", "m1", TEXT), 5)
    with pytest.raises(TurnError, match="belongs to the default tenant"):
        machine.submit(Configure("s1", "c1", tenant="acme"), 6)


def test_rebuilds_and_checkpoints_keep_the_tenant() -> None:
    machine = new_machine()
    machine.submit(FollowUp("s1", "m1", TEXT, tenant="acme"), 5)
    events = machine.take_events()
    assert scan_history(events).tenant == "acme"
    rebuilt = new_machine(SessionLog.from_events("s1", events))
    assert rebuilt.tenant == "acme"
    checkpoint = SessionCheckpoint("s1")
    checkpoint.advance(events)
    restored = SessionCheckpoint.from_json(json.loads(json.dumps(checkpoint.to_json())))
    log, history = restored.restore()
    assert history.tenant == "acme"
    with pytest.raises(TurnError, match="not to tenant 'globex'"):
        new_machine(log, history=history).submit(FollowUp("s1", "m2", TEXT, tenant="globex"), 9)


def test_a_history_written_before_tenants_reads_as_the_default_tenant() -> None:
    raw = History().to_json()
    del raw["tenant"]
    assert History.from_json(raw).tenant == ""
