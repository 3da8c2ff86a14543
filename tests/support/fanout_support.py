"""Helpers of the fan-out tests: settings without the registry (these tests never use it),
publishing fixture events, and the fixtures folder."""

from __future__ import annotations

from collections.abc import Iterable

from shared_paths import SHARED_DIR

from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.codec.avro import EventSerde
from pipeline.core.events import Event
from pipeline.services.replay.topic import event_records
from pipeline.settings import Settings

FIXTURES = SHARED_DIR / "fixtures" / "dsh-format0"
SERDE = EventSerde()


def fanout_settings(kafka_bootstrap: str, topic_prefix: str) -> Settings:
    return Settings.from_env({}, bootstrap_servers=kafka_bootstrap, topic_prefix=topic_prefix,
                             partitions=3, replication_factor=1,
                             group_id_prefix=f"{topic_prefix}g-")


async def publish(settings: Settings, session_id: str, events: Iterable[Event]) -> None:
    """Plain (non-transactional) publish, e.g. to plant defects the importer would refuse."""
    records = event_records(settings.topics.session_events, session_id, events, SERDE.encode)
    await send_records(settings, records)
