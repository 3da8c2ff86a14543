"""One consumer group's state and members (Kafka's DescribeGroups), described by one rule for
every caller: the dashboard's "processors running", the otel exporter's members metric.

The rule: a group whose answer carries an error raises :class:`BrokerError`. A principal that
may not Describe a group must never read as "nobody consumes".

One group per DescribeGroups request: aiokafka 0.14 sends version 3 of the request but reads
the answer with version 2's layout, which lacks the per-group ``authorized_operations``; with
several groups in one answer every group after the first is misread.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import for_code

from pipeline.adapters.kafka.admin import ADMIN_TIMEOUT_MS
from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options
from pipeline.settings import Settings

__all__ = ["GroupMembers", "describe_group", "group_members"]


@dataclass(frozen=True, slots=True)
class GroupMembers:
    group: str
    state: str  # Stable, PreparingRebalance, CompletingRebalance, Empty, Dead (no such group)
    members: int


async def describe_group(admin: AIOKafkaAdminClient, group: str) -> GroupMembers:
    """``group``'s state and member count; an unknown group is "Dead" with 0 members."""
    with broker_errors(f"describe consumer group {group!r}"):
        for response in await admin.describe_consumer_groups([group]):
            for described in response.groups:
                # (error_code, group_id, state, protocol_type, protocol, members, ...)
                if described[1] != group:
                    continue
                if described[0] != 0:
                    raise for_code(described[0])(f"group {group!r}")
                return GroupMembers(group, str(described[2]), len(described[5]))
    return GroupMembers(group, "Dead", 0)


async def group_members(settings: Settings, group: str) -> int:
    """How many members consumer group ``group`` has now (0: none, or no such group)."""
    admin = AIOKafkaAdminClient(**client_options(settings), request_timeout_ms=ADMIN_TIMEOUT_MS)
    with broker_errors(f"connect to {settings.bootstrap_servers}"):
        await admin.start()
    try:
        return (await describe_group(admin, group)).members
    finally:
        await admin.close()
