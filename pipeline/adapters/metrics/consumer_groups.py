"""The members of the project's consumer groups (Kafka's DescribeGroups), for the alert on a
group that has committed offsets but nobody left to consume.

One group per DescribeGroups request: aiokafka 0.14 sends version 3 of the request but reads
the answer with version 2's layout, which lacks the per-group ``authorized_operations``; with
several groups in one answer every group after the first is misread.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient

from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options
from pipeline.settings import Settings


@dataclass(frozen=True, slots=True)
class GroupMembers:
    group: str
    state: str  # Stable, PreparingRebalance, CompletingRebalance, Empty
    members: int


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
                for response in await admin.describe_consumer_groups([group]):
                    # (error_code, group_id, state, protocol_type, protocol, members, ...)
                    entry = response.groups[0]
                    if entry[0] == 0 and entry[2] != "Dead":
                        found.append(GroupMembers(str(entry[1]), str(entry[2]),
                                                  len(entry[5])))
        return found
