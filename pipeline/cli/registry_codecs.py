"""The codecs of the Confluent framing: what ``driver --registry`` and ``send --registry``
write; ``topics ensure`` and ``broker`` call it to register the subjects. Shared by those four
commands, so that none imports another's module."""

from __future__ import annotations

import json

from pipeline.adapters.registry.client import (
    BACKWARD_TRANSITIVE,
    RegistryClient,
    event_serde_for_topic,
    value_subject,
)
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.settings import Settings


def registry_codecs(settings: Settings, client: RegistryClient) -> tuple[EventSerde, InboxCodec]:
    """Codecs writing the Confluent framing with ids registered under ``<topic>-value``
    (TopicNameStrategy), compatibility BACKWARD_TRANSITIVE set explicitly."""
    topics = settings.topics
    serde = event_serde_for_topic(client, topics.session_events)
    inbox_codec = InboxCodec()
    subject = value_subject(topics.inbox)
    inbox_id = client.register(subject, json.dumps(inbox_codec.schema_json))
    client.set_compatibility(BACKWARD_TRANSITIVE, subject)
    return serde, InboxCodec(confluent_id=inbox_id, lookup=client.get_schema)
