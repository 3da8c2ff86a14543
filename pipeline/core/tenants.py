"""Tenants: which customer a session belongs to, and how the log keeps it.

A session belongs to one tenant for its whole life. The tenant is set by the session's first
command (``send --tenant T``, or the inbox record's ``tenant`` field for services); the
default tenant is the empty string, and a session in it carries no tenant event at all.

The driver logs a tenant as one extension event, :data:`TENANT_TYPE`, marked
``ignorable: true`` (DESIGN.md section 1: a reader that does not know the type skips it; it
is never on the surface and projects to no message), written before any other event of the
session and in the same transaction as the first command's events::

    {"type": "dsh-pipeline/tenant", "ignorable": true,
     "data": {"tenant": "<name>", "messageId": "<id of the command that set it>"}}

Rules kept here and by every reader:

- a name is 1 to 64 characters of ``A-Z a-z 0-9 . _ -`` (it appears in topic keys, metric
  labels and file names, so it carries no ``/``, space or control character);
- the first tenant event of a session wins; a later one (another writer's bug) is carried,
  not trusted (:func:`tenant_of_events`);
- a command for an existing session that names another tenant is refused, never applied: a
  tenant cannot write into another tenant's session (:func:`command_tenant_error`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Final

from pipeline.core.errors import ConfigError
from pipeline.core.events import Event, JsonValue

TENANT_TYPE: Final = "dsh-pipeline/tenant"
DEFAULT_TENANT: Final = ""
_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")


def checked_tenant(name: str) -> str:
    """``name`` when it is a valid tenant name (the default ``""`` included), else a
    :class:`ConfigError` saying what a name may hold."""
    if name == DEFAULT_TENANT or (isinstance(name, str) and _NAME.fullmatch(name)):
        return name
    raise ConfigError(f"tenant {name!r} is not a valid name: 1 to 64 characters of "
                      "A-Z a-z 0-9 . _ -")


def tenant_event_data(tenant: str, message_id: str) -> dict[str, JsonValue]:
    """The ``data`` of the :data:`TENANT_TYPE` event that puts a session in ``tenant``."""
    return {"tenant": checked_tenant(tenant), "messageId": message_id}


def tenant_of(data: JsonValue) -> str | None:
    """The tenant a :data:`TENANT_TYPE` event's data names; None when it does not fit (a
    reader keeps the session in the default tenant rather than trust a bad name)."""
    if not isinstance(data, Mapping):
        return None
    tenant = data.get("tenant")
    if not isinstance(tenant, str) or not _NAME.fullmatch(tenant):
        return None
    return tenant


def folded_tenant(current: str, data: JsonValue) -> str:
    """The session's tenant after a :data:`TENANT_TYPE` event with ``data``, the tenant
    being ``current`` before it: the first valid tenant event wins (every fold of the
    tenant, in the driver, the fleet and the usage, goes through here)."""
    return current if current != DEFAULT_TENANT else tenant_of(data) or DEFAULT_TENANT


def tenant_of_events(events: Iterable[Event]) -> str:
    """The tenant of a session from its events: the first valid tenant event, else ``""``."""
    tenant = DEFAULT_TENANT
    for event in events:
        if event.type == TENANT_TYPE:
            tenant = folded_tenant(tenant, event.data)
    return tenant


def command_tenant_error(session_tenant: str, command_tenant: str | None,
                         session_id: str) -> str | None:
    """Why a command naming ``command_tenant`` may not enter a session already in
    ``session_tenant``; None when it may (it names none, or the same one)."""
    if command_tenant is None or command_tenant == session_tenant:
        return None
    shown = f"tenant {session_tenant!r}" if session_tenant else "the default tenant"
    return (f"session {session_id!r} belongs to {shown}, not to tenant "
            f"{command_tenant!r}: a command cannot move a session to another tenant")
