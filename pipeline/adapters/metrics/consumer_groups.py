"""The members of the project's consumer groups, for the alert on a group that has committed
offsets but nobody left to consume. Each group is described by
:func:`pipeline.adapters.kafka.groups.describe_group`: a group the principal may not Describe
fails the sample instead of reading as empty.
"""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient

from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.groups import GroupMembers, describe_group
from pipeline.adapters.kafka.options import client_options
from pipeline.settings import Settings


class ConsumerGroupProbe:
    """Lists the groups whose id starts with ``prefix`` and counts their members."""

    def __init__(self, settings: Settings, prefix: str) -> None:
        self._settings = settings
        self._prefix = prefix
        self._admin: AIOKafkaAdminClient | None = None

    async def start(self) -> None:
        admin = AIOKafkaAdminClient(**client_options(self._settings))
        with broker_errors("start the consumer-group probe"):
            await admin.start()
        self._admin = admin

    async def stop(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            await admin.close()

    async def sample(self) -> list[GroupMembers]:
        admin = self._admin
        if admin is None:
            return []
        found: list[GroupMembers] = []
        with broker_errors("describe the consumer groups"):
            groups = sorted(str(g[0]) for g in await admin.list_consumer_groups()
                            if str(g[0]).startswith(self._prefix))
        for group in groups:
            described = await describe_group(admin, group)
            if described.state != "Dead":
                found.append(described)
        return found
