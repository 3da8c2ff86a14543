"""The schema-registry client against the real local Apicurio registry (conftest fixture)."""

from __future__ import annotations

import base64
import copy
import json
import socket
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from shared_paths import SHARED_DIR

from pipeline.adapters.registry.client import (
    RegistryClient,
    event_serde_for_topic,
    event_serde_for_topic_async,
    register_event_schema,
    value_subject,
)
from pipeline.codec.avro import EventSerde
from pipeline.codec.schemas import SchemaTable, current_event_schema
from pipeline.core.errors import ConfigError, RegistryError, SchemaError
from pipeline.core.events import Event, event_from_json
from pipeline.settings import Secret, Settings

pytestmark = pytest.mark.registry
FIXTURES = (SHARED_DIR / "fixtures")


def _fixture_events() -> list[Event]:
    events = []
    for line in (FIXTURES / "dsh-format0" / "tool-call-turn.jsonl").read_text().splitlines():
        obj = json.loads(line)
        if "seq" in obj:  # neither the header nor a packed chunk row
            events.append(event_from_json(obj))
    return events


def _with_new_type(schema: dict[str, Any]) -> dict[str, Any]:
    """Today's schema plus a typed record for a new event type: a compatible change."""
    evolved = copy.deepcopy(schema)
    payload = next(f for f in evolved["fields"] if f["name"] == "payload")
    payload["type"].append({"type": "record", "name": "SessionTitle",
                            "dsh.eventTypes": ["session/title"],
                            "fields": [{"name": "title", "type": "string"},
                                       {"name": "extra", "type": ["null", "string"],
                                        "default": None, "dsh.json": True}]})
    return evolved


def _without_seq(schema: dict[str, Any]) -> dict[str, Any]:
    """A new required field without default: old records cannot be read, incompatible."""
    broken = copy.deepcopy(schema)
    broken["fields"].append({"name": "partition", "type": "int"})
    return broken


@pytest.fixture
def client(registry_url: str) -> Any:
    with RegistryClient(registry_url) as registry:
        yield registry


def test_register_fetch_and_compatibility_set_explicitly(client: RegistryClient) -> None:
    topic = f"t{uuid.uuid4().hex[:10]}.session-events"
    subject = value_subject(topic)
    schema_id = register_event_schema(client, topic)
    assert subject in client.subjects()
    assert client.get_compatibility(subject) == "BACKWARD_TRANSITIVE"
    client.set_compatibility("BACKWARD_TRANSITIVE")  # what the fixture set: harmless
    assert client.get_compatibility() == "BACKWARD_TRANSITIVE"

    fresh = RegistryClient(client.base_url)  # no cache: really fetched by id
    fetched = json.loads(fresh.get_schema(schema_id))
    fresh.close()
    assert fetched["name"] in {"SessionEvent", "dsh.SessionEvent"}
    assert register_event_schema(client, topic) == schema_id  # idempotent

    current = current_event_schema().schema
    assert client.is_compatible(subject, json.dumps(_with_new_type(current)))
    assert not client.is_compatible(subject, json.dumps(_without_seq(current)))
    with pytest.raises(RegistryError, match="HTTP 409"):
        client.register(subject, json.dumps(_without_seq(current)))
    evolved_id = client.register(subject, json.dumps(_with_new_type(current)))
    assert evolved_id != schema_id
    assert client.latest(subject)[0] == evolved_id


def test_confluent_framing_round_trip_with_registry_ids(client: RegistryClient) -> None:
    topic = f"t{uuid.uuid4().hex[:10]}.session-events"
    writer = event_serde_for_topic(client, topic)
    assert writer.framing == "confluent" and writer.schema_id is not None
    with RegistryClient(client.base_url) as fresh:
        reader = EventSerde(SchemaTable(fresh.get_schema))
        for event in _fixture_events():
            data = writer.encode("session-9", event)
            assert data[0] == 0 and int.from_bytes(data[1:5], "big") == writer.schema_id
            session_id, decoded = reader.decode(data)
            assert session_id == "session-9"
            assert json.dumps(decoded.to_json()) == json.dumps(event.to_json())


async def test_registration_from_an_event_loop(client: RegistryClient) -> None:
    topic = f"t{uuid.uuid4().hex[:10]}.session-events"
    serde = await event_serde_for_topic_async(client, topic)
    assert serde.schema_id == client.latest(value_subject(topic))[0]


def test_unknown_id_and_bad_schema_are_clear_errors(client: RegistryClient) -> None:
    with pytest.raises(RegistryError, match="schema id 987654321"):
        client.get_schema(987654321)
    reader = EventSerde(SchemaTable(client.get_schema))
    with pytest.raises(RegistryError, match="987654321"):
        reader.decode(b"\x00" + (987654321).to_bytes(4, "big") + b"\x00")
    subject = f"t{uuid.uuid4().hex[:10]}-value"
    with pytest.raises(RegistryError, match="refused"):
        client.register(subject, '{"type": "record", "name": "X"}')  # no fields
    no_registry = EventSerde()
    with pytest.raises(SchemaError, match="no registry"):
        no_registry.decode(b"\x00\x00\x00\x00\x07\x00")


def test_unreachable_registry_never_shows_the_password() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = Settings.from_env({}, registry_url=f"http://127.0.0.1:{port}/apis/ccompat/v7",
                                 registry_username="svc", registry_password=Secret("hunter2"))
    with RegistryClient.from_settings(settings) as registry, \
            pytest.raises(RegistryError) as caught:
        registry.subjects()
    assert "hunter2" not in str(caught.value) and f"127.0.0.1:{port}" in str(caught.value)
    with pytest.raises(ConfigError):
        RegistryClient("ftp://user:hunter2@example/x")
    with pytest.raises(ConfigError) as bad_level:
        RegistryClient("http://u:hunter2@127.0.0.1:1/").set_compatibility("SOMETIMES")
    assert "hunter2" not in str(bad_level.value)


class _AuthRegistry(BaseHTTPRequestHandler):
    """A tiny real HTTP server answering GET /subjects only with the right basic auth."""

    expected = "Basic " + base64.b64encode(b"svc:s3cret-pw").decode()

    def do_GET(self) -> None:  # http.server calls do_<METHOD>
        ok = self.headers.get("Authorization") == self.expected
        body = json.dumps(["a-value"] if ok else {"error_code": 40101,
                                                  "message": "Unauthorized"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def auth_registry() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AuthRegistry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/apis/ccompat/v7"
    finally:
        server.shutdown()
        server.server_close()


def test_basic_auth_from_settings(auth_registry: str) -> None:
    good = Settings.from_env({}, registry_url=auth_registry, registry_username="svc",
                             registry_password=Secret("s3cret-pw"))
    with RegistryClient.from_settings(good) as registry:
        assert registry.subjects() == ["a-value"]
    bad = Settings.from_env({}, registry_url=auth_registry, registry_username="svc",
                            registry_password=Secret("wrong-pw"))
    with RegistryClient.from_settings(bad) as registry, \
            pytest.raises(RegistryError, match="HTTP 401 \\(error 40101\\)") as caught:
        registry.subjects()
    assert "wrong-pw" not in str(caught.value) and "svc" not in str(caught.value)
