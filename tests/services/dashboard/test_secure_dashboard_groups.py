"""The dashboard's principal on the secure stack sees the project's consumer groups: the lag
panel's committed offsets and the processors' members (Kafka lists and describes only the
groups a principal may Describe), and a group it may not describe is an error, not "nobody
consumes"."""

from __future__ import annotations

import time

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from secure_support import SecureStack

from pipeline.adapters.kafka.groups import group_members
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.metrics.consumer_lag import ConsumerLagProbe
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings

pytestmark = [pytest.mark.broker, pytest.mark.registry]


async def _commit_as(settings: Settings, group: str, tp: TopicPartition) -> None:
    """``group`` commits offset 0 of ``tp`` (as the principal of ``settings``)."""
    consumer = AIOKafkaConsumer(group_id=group, enable_auto_commit=False,
                                **client_options(settings))
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: 0})
    finally:
        await consumer.stop()


async def test_the_dashboard_principal_reads_the_lag_and_members_of_the_project_groups(
        secure_stack: SecureStack) -> None:
    driver, dashboard = secure_stack.role("driver"), secure_stack.role("dashboard")
    driver_group = f"{driver.group_id_prefix}driver"
    await _commit_as(driver, driver_group, TopicPartition(driver.topics.inbox, 0))

    probe = ConsumerLagProbe(dashboard, (dashboard.topics.inbox,
                                         dashboard.topics.session_events))
    await probe.start()
    try:
        await probe.sample(int(time.time() * 1000))   # learns the leaders
        samples = await probe.sample(int(time.time() * 1000))
        ends = probe.ends   # both ends: read committed and uncommitted
    finally:
        await probe.stop()
    assert (driver_group, dashboard.topics.inbox, 0) in {
        (s.group, s.topic, s.partition) for s in samples}
    assert {(dashboard.topics.inbox, 0), (dashboard.topics.session_events, 0)} <= {
        (e.topic, e.partition) for e in ends}

    assert await group_members(dashboard, dashboard.processors_group()) == 0  # none running


async def test_a_group_the_principal_may_not_describe_is_an_error(
        secure_stack: SecureStack) -> None:
    """The ingest principal holds no Describe on the driver's group: asking how many members
    it has raises, naming the missing permission (it used to read as 0 members)."""
    ingest = secure_stack.role("ingest")
    with pytest.raises(BrokerError, match="not authorized for the consumer group"):
        await group_members(ingest, f"{ingest.group_id_prefix}driver")
