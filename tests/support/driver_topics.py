"""The Kafka topics of a driver test: settings of the test's own (its topic prefix, its
group ids, the fixture broker, no registry: the driver needs none), the topics created.

The ``topics`` fixture (tests/conftest.py) is :func:`driver_topics` with :data:`PARTITIONS`;
the tests that start a driver process give it the same count (``DSH_PARTITIONS``).
"""

from __future__ import annotations

from typing import Final

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.settings import Settings

PARTITIONS: Final = 3


async def driver_topics(kafka_bootstrap: str, topic_prefix: str,
                        partitions: int = PARTITIONS) -> Settings:
    """Settings on ``topic_prefix`` with ``partitions`` partitions, once their topics exist."""
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap, topic_prefix=topic_prefix,
                                 partitions=partitions, replication_factor=1,
                                 group_id_prefix=f"{topic_prefix}g-")
    await ensure_topics(settings)
    return settings
