"""Registering the derived outputs' value schemas (one subject per output topic).

``derived-messages`` -> ``dsh.DerivedMessageChange``, ``usage`` -> ``dsh.UsageRecord``,
``fleet`` -> ``dsh.FleetStatus``, each under ``<topic>-value`` (TopicNameStrategy) with
compatibility BACKWARD_TRANSITIVE set explicitly, as the session-event and inbox subjects.
The rebuilt versions of the derived messages (``<topic>.vN``, written by replay and, once
switched, by the processors) share the base topic's subject: one projection, one schema
history, and a reader of any version resolves the same ids.
Synchronous (start-up only); :func:`output_codecs_for_topics_async` runs it off the loop.
"""

from __future__ import annotations

import asyncio

from pipeline.adapters.registry.client import BACKWARD_TRANSITIVE, RegistryClient, value_subject
from pipeline.codec.outputs import (
    DERIVED_MESSAGE_CHANGE,
    FLEET_STATUS,
    USAGE_RECORD,
    OutputCodecs,
    OutputDecoder,
    OutputSchemaTable,
    current_output_schema,
)
from pipeline.codec.schemas import SchemaLookup
from pipeline.settings import Settings, TopicNames


def output_topics(topics: TopicNames) -> dict[str, str]:
    """Output schema name -> the topic whose subject it is registered under."""
    return {DERIVED_MESSAGE_CHANGE: topics.derived_messages, USAGE_RECORD: topics.usage,
            FLEET_STATUS: topics.fleet}


def register_output_schemas(client: RegistryClient, topics: TopicNames, *,
                            compatibility: str = BACKWARD_TRANSITIVE) -> dict[str, int]:
    """Register today's output schemas, one subject per topic, the rule set explicitly
    (after the first registration: Apicurio wants the subject to exist); the registry ids
    by schema name. Idempotent."""
    ids: dict[str, int] = {}
    for name, topic in output_topics(topics).items():
        subject = value_subject(topic)
        ids[name] = client.register(subject, current_output_schema(name).text())
        client.set_compatibility(compatibility, subject)
    return ids


def output_codecs_for_topics(client: RegistryClient, topics: TopicNames) -> OutputCodecs:
    """Output serdes writing the Confluent framing with the registered ids, reading any id
    through the registry (once per id)."""
    ids = register_output_schemas(client, topics)
    return OutputCodecs.confluent(ids, client.get_schema)


async def output_codecs_for_topics_async(client: RegistryClient, topics: TopicNames
                                         ) -> OutputCodecs:
    """:func:`output_codecs_for_topics` off the event loop (registration blocks on HTTP)."""
    return await asyncio.to_thread(output_codecs_for_topics, client, topics)


def registry_lookup(settings: Settings) -> SchemaLookup:
    """Schema text by registry id through the settings' registry. A client per call: the
    schema table fetches an id once and caches it, and a reader that never meets a
    Confluent-framed record connects to nothing."""
    def lookup(schema_id: int) -> str:
        with RegistryClient.from_settings(settings) as client:
            return client.get_schema(schema_id)
    return lookup


def output_decoder(settings: Settings) -> OutputDecoder:
    """A decoder of the output topics that resolves registry ids through the settings'
    registry (single-object records and legacy JSON need none)."""
    return OutputDecoder(OutputSchemaTable(registry_lookup(settings)))
