"""The derived outputs' subjects on the real local Apicurio registry (conftest fixture)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from pipeline.adapters.registry.client import RegistryClient, value_subject
from pipeline.adapters.registry.outputs import (
    output_codecs_for_topics,
    output_codecs_for_topics_async,
    register_output_schemas,
)
from pipeline.codec.outputs import (
    DERIVED_MESSAGE_CHANGE,
    FLEET_STATUS,
    USAGE_RECORD,
    OutputDecoder,
    OutputSchemaTable,
    current_output_schema,
)
from pipeline.core.fleet import FleetStatus
from pipeline.core.projection import MessageChange
from pipeline.core.usage import TokenCounts, session_record
from pipeline.settings import TopicNames

pytestmark = pytest.mark.registry


@pytest.fixture
def client(registry_url: str) -> Any:
    with RegistryClient(registry_url) as registry:
        yield registry


def _topics() -> TopicNames:
    return TopicNames(f"t{uuid.uuid4().hex[:10]}.")


def test_one_subject_per_output_topic_with_the_rule_set(client: RegistryClient) -> None:
    topics = _topics()
    ids = register_output_schemas(client, topics)
    subjects = {DERIVED_MESSAGE_CHANGE: value_subject(topics.derived_messages),
                USAGE_RECORD: value_subject(topics.usage),
                FLEET_STATUS: value_subject(topics.fleet)}
    for name, subject in subjects.items():
        assert subject in client.subjects()
        assert client.get_compatibility(subject) == "BACKWARD_TRANSITIVE"
        assert client.latest(subject)[0] == ids[name]
        assert json.loads(client.get_schema(ids[name]))["name"] in {name, name.split(".")[1]}
    assert register_output_schemas(client, topics) == ids  # idempotent
    # An incompatible change (a new field without a default) is refused.
    broken = dict(current_output_schema(USAGE_RECORD).schema)
    broken["fields"] = [*broken["fields"], {"name": "gen_ai_usage_total", "type": "long"}]
    assert not client.is_compatible(subjects[USAGE_RECORD], json.dumps(broken))


async def test_confluent_framed_outputs_decode_through_the_registry(
        client: RegistryClient, registry_url: str) -> None:
    topics = _topics()
    writer = await output_codecs_for_topics_async(client, topics)
    change = MessageChange("s-1", 0, 3, 3, "append", {"role": "user", "content": "hi"})
    values = [(writer.derived.encode_change(change), change.to_json()),
              (writer.usage.encode(session_record("s-1", TokenCounts(1, 2, 3, 4, 5, 1))),
               session_record("s-1", TokenCounts(1, 2, 3, 4, 5, 1))),
              (writer.fleet.encode(FleetStatus("s-1").to_json()), FleetStatus("s-1").to_json())]
    with RegistryClient(registry_url) as fresh:  # no cache: ids really fetched
        reader = OutputDecoder(OutputSchemaTable(fresh.get_schema))
        for data, expected in values:
            assert data is not None and data[0] == 0
            assert reader.decode(data) == expected
    # Registering again (another process, a restart) gives the same ids.
    again = output_codecs_for_topics(client, topics)
    assert again.usage.schema_id == writer.usage.schema_id
    assert again.derived.schema_id == writer.derived.schema_id
