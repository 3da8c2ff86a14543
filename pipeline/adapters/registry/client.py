"""Client of the Confluent-compatible schema registry API (Apicurio's ``/apis/ccompat/v7``).

The only module that talks HTTP to the registry. Every failure (connection, timeout, HTTP
error status, unreadable answer) becomes a :class:`RegistryError` in :meth:`_request`,
naming the operation, the status and the registry's own error code and message; the URL in
messages never carries credentials, and the password (a :class:`Secret`) is revealed only to
httpx's basic-auth.

Synchronous on purpose: registration happens once at start-up and a schema is fetched once
per unknown id (then cached), so callers on an event loop can afford a blocking call or wrap
one in ``asyncio.to_thread``; the per-record hot path never reaches this module.

Conventions (DESIGN.md section 2): one subject per topic (TopicNameStrategy,
``<topic>-value``), compatibility BACKWARD_TRANSITIVE set explicitly (Apicurio has no rule
by default), schema ids from the registry's own id space (never assumed).
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from types import TracebackType
from typing import Any, Final
from urllib.parse import quote

import httpx

from pipeline.adapters.urls import without_userinfo
from pipeline.codec.avro import EventSerde
from pipeline.codec.schemas import SchemaTable, current_event_schema
from pipeline.core.errors import ConfigError, RegistryError
from pipeline.settings import Secret, Settings

CONTENT_TYPE: Final = "application/vnd.schemaregistry.v1+json"
BACKWARD_TRANSITIVE: Final = "BACKWARD_TRANSITIVE"
COMPATIBILITY_LEVELS: Final = frozenset({
    "NONE", "BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL",
    "FULL_TRANSITIVE",
})


def value_subject(topic: str) -> str:
    """The subject of a topic's record values under TopicNameStrategy."""
    return f"{topic}-value"


class RegistryClient:
    """Register and fetch Avro schemas, read and set compatibility. Thread-safe."""

    def __init__(self, base_url: str, *, username: str = "", password: Secret | None = None,
                 timeout_s: float = 10.0, verify: ssl.SSLContext | bool = True) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"registry URL must start with http:// or https://, got "
                              f"{without_userinfo(base_url, drop_query=True)!r}")
        self.base_url = base_url.rstrip("/")
        self.public_url = without_userinfo(self.base_url, drop_query=True)
        auth = httpx.BasicAuth(username, password.reveal() if password else "") \
            if username else None
        self._http = httpx.Client(base_url=self.base_url, auth=auth, timeout=timeout_s,
                                  verify=verify, headers={"Accept": CONTENT_TYPE})
        self._schemas: dict[int, str] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> RegistryClient:
        verify: ssl.SSLContext | bool = True
        if settings.ssl_cafile:
            try:
                verify = ssl.create_default_context(cafile=settings.ssl_cafile)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"DSH_SSL_CAFILE {settings.ssl_cafile!r} cannot be used: "
                                  f"{exc}") from None
        return cls(settings.registry_url, username=settings.registry_username,
                   password=settings.registry_password, verify=verify)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- the one place where HTTP errors are translated ---------------------------------------
    def _request(self, what: str, method: str, path: str, body: Any = None) -> Any:
        try:
            response = self._http.request(
                method, path, json=body,
                headers={"Content-Type": CONTENT_TYPE} if body is not None else None)
        except httpx.HTTPError as exc:
            raise RegistryError(f"schema registry at {self.public_url}: {what} failed: "
                                f"{type(exc).__name__}: {exc}") from None
        if response.status_code >= 400:
            raise RegistryError(f"schema registry at {self.public_url}: {what} refused: "
                                f"HTTP {response.status_code}{_error_detail(response)}")
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise RegistryError(f"schema registry at {self.public_url}: {what}: answer is "
                                f"not JSON: {response.text[:200]!r}") from None

    # -- schemas ------------------------------------------------------------------------------
    def register(self, subject: str, schema_text: str) -> int:
        """Find, else register, an Avro schema under ``subject``; its registry id.

        Finding first is a read: a read-only principal (``sr-readonly``) gets the id of a
        schema the admin registered; registering needs ``sr-developer`` or ``sr-admin``.
        """
        found = self.lookup(subject, schema_text)
        if found is not None:
            return found
        answer = self._request(f"register schema under {subject!r}", "POST",
                               f"/subjects/{_seg(subject)}/versions",
                               {"schema": schema_text, "schemaType": "AVRO"})
        schema_id = _int_field(answer, "id", f"register under {subject!r}")
        with self._lock:
            self._schemas[schema_id] = schema_text
        return schema_id

    def lookup(self, subject: str, schema_text: str) -> int | None:
        """The id of ``schema_text`` if it is registered under ``subject``, else None."""
        try:
            response = self._http.post(f"/subjects/{_seg(subject)}",
                                       json={"schema": schema_text, "schemaType": "AVRO"},
                                       headers={"Content-Type": CONTENT_TYPE})
        except httpx.HTTPError as exc:
            raise RegistryError(f"schema registry at {self.public_url}: look up schema under "
                                f"{subject!r} failed: {type(exc).__name__}: {exc}") from None
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise RegistryError(f"schema registry at {self.public_url}: look up schema under "
                                f"{subject!r} refused: HTTP {response.status_code}"
                                f"{_error_detail(response)}")
        schema_id = _int_field(response.json(), "id", f"look up under {subject!r}")
        with self._lock:
            self._schemas[schema_id] = schema_text
        return schema_id

    def get_schema(self, schema_id: int) -> str:
        """The schema text of a registry id (fetched once, then cached)."""
        with self._lock:
            cached = self._schemas.get(schema_id)
        if cached is not None:
            return cached
        answer = self._request(f"fetch schema id {schema_id}", "GET",
                               f"/schemas/ids/{int(schema_id)}")
        text = answer.get("schema") if isinstance(answer, dict) else None
        if not isinstance(text, str):
            raise RegistryError(f"schema registry at {self.public_url}: schema id {schema_id}:"
                                f" answer has no 'schema' text")
        with self._lock:
            self._schemas[schema_id] = text
        return text

    def latest(self, subject: str) -> tuple[int, int, str]:
        """(id, version, schema text) of the latest version under ``subject``."""
        answer = self._request(f"read latest version of {subject!r}", "GET",
                               f"/subjects/{_seg(subject)}/versions/latest")
        where = f"latest of {subject!r}"
        text = answer.get("schema") if isinstance(answer, dict) else None
        if not isinstance(text, str):
            raise RegistryError(f"schema registry at {self.public_url}: {where}: no schema")
        return _int_field(answer, "id", where), _int_field(answer, "version", where), text

    def subjects(self) -> list[str]:
        answer = self._request("list subjects", "GET", "/subjects")
        if not isinstance(answer, list):
            raise RegistryError(f"schema registry at {self.public_url}: subjects: not a list")
        return [str(s) for s in answer]

    # -- compatibility ------------------------------------------------------------------------
    def set_compatibility(self, level: str, subject: str | None = None) -> None:
        """Set the compatibility rule globally (subject None) or for one subject."""
        if level not in COMPATIBILITY_LEVELS:
            raise ConfigError(f"unknown compatibility level {level!r}; one of "
                              f"{sorted(COMPATIBILITY_LEVELS)}")
        path = "/config" if subject is None else f"/config/{_seg(subject)}"
        if self._compatibility_is(level, path):
            return  # already in force: a read-only principal may go on
        self._request(f"set compatibility of {subject or 'the registry'}", "PUT", path,
                      {"compatibility": level})

    def _compatibility_is(self, level: str, path: str) -> bool:
        try:
            response = self._http.get(path)
            answer = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return False
        return isinstance(answer, dict) and level in (answer.get("compatibilityLevel"),
                                                      answer.get("compatibility"))

    def get_compatibility(self, subject: str | None = None) -> str:
        """The compatibility rule in force (global when subject is None)."""
        path = "/config" if subject is None else f"/config/{_seg(subject)}"
        answer = self._request(f"read compatibility of {subject or 'the registry'}", "GET",
                               path)
        level = answer.get("compatibilityLevel", answer.get("compatibility")) \
            if isinstance(answer, dict) else None
        if not isinstance(level, str):
            raise RegistryError(f"schema registry at {self.public_url}: no compatibility "
                                f"level in {answer!r:.200}")
        return level

    def is_compatible(self, subject: str, schema_text: str, version: str = "latest") -> bool:
        """Whether ``schema_text`` may be registered next under ``subject``."""
        answer = self._request(f"test compatibility under {subject!r}", "POST",
                               f"/compatibility/subjects/{_seg(subject)}/versions/"
                               f"{_seg(version)}",
                               {"schema": schema_text, "schemaType": "AVRO"})
        verdict = answer.get("is_compatible") if isinstance(answer, dict) else None
        if not isinstance(verdict, bool):
            raise RegistryError(f"schema registry at {self.public_url}: compatibility test "
                                f"answer without 'is_compatible': {answer!r:.200}")
        return verdict


def _seg(text: str) -> str:
    return quote(text, safe="")


def _int_field(answer: Any, name: str, where: str) -> int:
    value = answer.get(name) if isinstance(answer, dict) else None
    if not isinstance(value, int) or isinstance(value, bool):
        raise RegistryError(f"schema registry: {where}: answer has no integer {name!r}: "
                            f"{answer!r:.200}")
    return value


def _error_detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f": {response.text[:200]}" if response.text else ""
    if isinstance(body, dict):
        code, message = body.get("error_code"), body.get("message")
        return f" (error {code}): {str(message)[:300]}"
    return f": {str(body)[:200]}"


def register_event_schema(client: RegistryClient, topic: str,
                          compatibility: str = BACKWARD_TRANSITIVE) -> int:
    """Register today's session-event schema for ``topic``'s values, with the subject's
    compatibility rule set explicitly; the registry id to frame records with.

    The rule is set after the first registration (a subject must exist before Apicurio
    accepts a per-subject rule) and before any later version can be registered.
    """
    subject = value_subject(topic)
    schema_id = client.register(subject, current_event_schema().text())
    client.set_compatibility(compatibility, subject)
    return schema_id


def event_serde_for_topic(client: RegistryClient, topic: str) -> EventSerde:
    """An EventSerde writing Confluent-framed records with the registered id of today's
    schema, and reading any id through the registry (once per id)."""
    schema_id = register_event_schema(client, topic)
    return EventSerde(SchemaTable(client.get_schema), schema_id=schema_id)


async def event_serde_for_topic_async(client: RegistryClient, topic: str) -> EventSerde:
    """:func:`event_serde_for_topic` off the event loop (registration blocks on HTTP)."""
    return await asyncio.to_thread(event_serde_for_topic, client, topic)
