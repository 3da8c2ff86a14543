"""Approval commands on the wire (InboxCommand v2) and pending approvals in the fleet status."""

from __future__ import annotations

import io
import json

import fastavro
import pytest

from pipeline.codec.inbox import SCHEMA_DIR, InboxCodec, schema_fingerprint
from pipeline.codec.schemas import SINGLE_OBJECT_MAGIC
from pipeline.core.errors import EventError
from pipeline.core.events import Event
from pipeline.core.fleet import FleetStatus, fleet_counters
from pipeline.core.inbox import Approve, Configure, Deny, FollowUp, command_from_json
from pipeline.sdk import PendingApproval, pending_approvals

COMMANDS = [
    Approve("s1", "a1", "call-1"),
    Approve("s1", "a2", "call-1", reason="ok", source={"kind": "user", "name": "alice"}),
    Deny("s1", "d1", "call-1", reason="not on prod"),
    Configure("s1", "c1", require_approval=("bash", "mcp__*"), approval_policy="never"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.message_id)
def test_approval_commands_round_trip(command: object) -> None:
    codec = InboxCodec()
    assert codec.decode(codec.encode(command)) == command  # type: ignore[arg-type]


def test_a_v1_record_decodes_with_todays_schema() -> None:
    v1 = json.loads((SCHEMA_DIR / "history/dsh.InboxCommand.v1.avsc").read_text())
    record = {f["name"]: None for f in v1["fields"]}
    record.update(kind="followup", sessionId="s1", messageId="m1",
                  content='[{"type":"text","text":"hi"}]')
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(v1), record)
    data = SINGLE_OBJECT_MAGIC + schema_fingerprint(v1) + body.getvalue()
    assert InboxCodec().decode(data) == FollowUp("s1", "m1", ({"type": "text", "text": "hi"},))


def test_a_decision_without_call_id_is_refused() -> None:
    with pytest.raises(EventError, match="callId must be a non-empty string"):
        command_from_json({"kind": "deny", "sessionId": "s1", "messageId": "d1"})
    with pytest.raises(EventError, match="approvalPolicy must be ask or never"):
        command_from_json({"kind": "configure", "sessionId": "s1", "messageId": "c1",
                           "approvalPolicy": "sometimes"})


def test_the_fleet_row_shows_the_pending_approval_until_it_is_decided() -> None:
    status = FleetStatus("s1")
    status.apply(Event("turn/start", 0, 10, {"turn": 1}))
    status.apply(Event("approval/asked", 1, 20, {"id": "q", "toolName": "bash",
                                                  "callId": "c1"}))
    assert (status.approval_call_id, status.approval_tool, status.approval_since_ms) == \
        ("c1", "bash", 20)
    assert fleet_counters([status], now_ms=30, active_within_ms=1).pending_approvals == 1
    status.apply(Event("approval/decided", 2, 40, {"id": "q", "outcome": "allowed-once"}))
    assert status.approval_call_id is None and status.approval_since_ms is None
    status.apply(Event("approval/asked", 3, 50, {"id": "q2", "toolName": "bash",
                                                  "callId": "c2"}))
    status.apply(Event("turn/end", 4, 60, {"turn": 1, "reason": {"kind": "interrupted"}}))
    assert status.approval_call_id is None


def test_the_sdk_lists_pending_approvals_oldest_first() -> None:
    rows = {"s1": FleetStatus("s1").to_json(),
            "s2": {**FleetStatus("s2").to_json(), "approval_call_id": "c2",
                   "approval_tool": "bash", "approval_since_ms": 200},
            "s3": {**FleetStatus("s3").to_json(), "approval_call_id": "c3",
                   "approval_tool": None, "approval_since_ms": 100}}
    assert pending_approvals(rows) == [PendingApproval("s3", "c3", None, 100),
                                       PendingApproval("s2", "c2", "bash", 200)]
