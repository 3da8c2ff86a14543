"""The dashboard's one write: a person's decision on a tool call waiting for approval.

``POST /api/sessions/{session_id}/approvals/{call_id}`` with a JSON body ``{"decision":
"approve" | "deny", "reason"?}`` puts an approve or deny command on the session's inbox, as
``dsh-pipeline send --approve/--deny`` does; the driver logs it (who: the basic-auth user
name, else ``dashboard``; when; why) and applies it, or refuses it when another decision
came first (the session log says so). It is refused here, before anything is sent:

- 403 when the dashboard has no token (``DSH_DASHBOARD_TOKEN``): deciding needs a person who
  proved who they are (the token guard of :mod:`pipeline.services.dashboard.web` has let the
  request through by then);
- 415 unless the body is ``application/json``: a cross-site form cannot send that type
  without a CORS preflight, which this server never grants.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from typing import Final

from aiohttp import web

from pipeline.adapters.kafka.plain_producer import inbox_command_record, send_records
from pipeline.core.errors import DshError
from pipeline.core.events import JsonValue, dumps_json
from pipeline.core.inbox import Approve, Deny
from pipeline.settings import Settings

DECISION_PATH: Final = "/api/sessions/{session_id}/approvals/{call_id}"


def is_decision_path(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 6 and parts[1:3] == ["api", "sessions"] and parts[4] == "approvals"


def _json(body: JsonValue, status: int) -> web.Response:
    return web.Response(text=dumps_json(body), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _who(header: str | None) -> str:
    """The basic-auth user name (the person), else ``dashboard``."""
    scheme, _, value = (header or "").strip().partition(" ")
    if scheme.lower() == "basic":
        try:
            name = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return "dashboard"
        return name.partition(":")[0] or "dashboard"
    return "dashboard"


async def decide(request: web.Request, settings: Settings, has_token: bool
                 ) -> web.StreamResponse:
    if not has_token:
        return _json({"error": "deciding approvals needs a dashboard token "
                               "(DSH_DASHBOARD_TOKEN)"}, 403)
    if request.content_type != "application/json":
        return _json({"error": "the body must be application/json"}, 415)
    try:
        body = json.loads(await request.text())
    except ValueError:
        return _json({"error": "the body is not JSON"}, 400)
    decision = body.get("decision") if isinstance(body, dict) else None
    reason = body.get("reason") if isinstance(body, dict) else None
    if decision not in ("approve", "deny") or not isinstance(reason, str | None):
        return _json({"error": 'give {"decision": "approve" | "deny", "reason"?: text}'}, 400)
    kind = Approve if decision == "approve" else Deny
    session_id, call_id = request.match_info["session_id"], request.match_info["call_id"]
    command = kind(session_id, str(uuid.uuid4()), call_id, reason=reason or None,
                   source={"kind": "user", "name": _who(request.headers.get("Authorization")),
                           "via": "dashboard"})
    record = inbox_command_record(settings, command)
    try:
        [(partition, offset)] = await send_records(settings, [record], timeout_s=10.0)
    except DshError as exc:
        return _json({"error": f"the inbox did not take it: {exc}"}, 503)
    return _json({"sessionId": session_id, "callId": call_id, "decision": decision,
                  "messageId": command.message_id, "partition": partition,
                  "offset": offset}, 202)
