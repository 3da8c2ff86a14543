"""The fixture broker carries records; ensure_topics creates the planned topics and refuses
existing ones that do not match (partition count, cleanup policy)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from pipeline.adapters.kafka.admin import ensure_topics, plan_topics, topic_configs
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.metrics.consumer_lag import leaders_ready
from pipeline.core.errors import BrokerError, ConfigError
from pipeline.settings import Secret, Settings


async def test_produce_consume_round_trip(settings: Settings, group_id: str) -> None:
    topic = settings.topic_prefix + "roundtrip"
    sent = [(f"s{i % 3}".encode(), f"value {i}".encode()) for i in range(30)]
    producer = AIOKafkaProducer(**client_options(settings), acks="all")
    await producer.start()
    try:
        for key, value in sent:
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, **client_options(settings), group_id=group_id,
                                auto_offset_reset="earliest")
    await consumer.start()
    received: list[tuple[bytes, bytes]] = []
    try:
        while len(received) < len(sent):
            batch = await consumer.getmany(timeout_ms=10_000)
            assert batch, f"no records within 10 s after {len(received)} of {len(sent)}"
            for records in batch.values():
                received += [(r.key, r.value) for r in records]
    finally:
        await consumer.stop()
    assert sorted(received) == sorted(sent)


async def test_ensure_topics_creates_planned_configs_and_is_idempotent(
        settings: Settings) -> None:
    first = await ensure_topics(settings)
    names = settings.topics
    assert set(first.created) == {s.name for s in plan_topics(settings)}
    assert first.existing == ()

    events = await topic_configs(settings, names.session_events)
    assert (events["cleanup.policy"], events["retention.ms"], events["retention.bytes"]) == (
        "delete", "-1", "-1")
    assert (await topic_configs(settings, names.inbox))["cleanup.policy"] == "delete"
    for derived in (names.derived_messages, names.usage, names.fleet):
        assert (await topic_configs(settings, derived))["cleanup.policy"] == "compact"
    for dlq in (names.dlq(names.session_events), names.dlq(names.inbox)):
        assert (await topic_configs(settings, dlq))["cleanup.policy"] == "delete"
    for spec in plan_topics(settings):  # the one record limit, on every topic
        found = await topic_configs(settings, spec.name)
        assert found["max.message.bytes"] == str(settings.max_record_bytes)

    second = await ensure_topics(settings)
    assert second.created == ()
    assert set(second.existing) == set(first.created)


async def test_ensure_topics_run_at_once_by_two_services_both_succeed(
        settings: Settings) -> None:
    """A driver and a processors worker starting together: each finds the topics the other
    created meanwhile (TopicAlreadyExists) and checks them once visible."""
    reports = await asyncio.gather(ensure_topics(settings), ensure_topics(settings))
    planned = {s.name for s in plan_topics(settings)}
    for report in reports:
        assert set(report.created) | set(report.existing) == planned
    assert set(reports[0].created) | set(reports[1].created) == planned


async def _create_topic(settings: Settings, name: str, partitions: int,
                        configs: dict[str, str]) -> None:
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1, topic_configs=configs)])
    finally:
        await admin.close()


async def test_ensure_topics_refuses_a_co_partitioning_mismatch(settings: Settings) -> None:
    await _create_topic(settings, settings.topics.inbox, 5, {"cleanup.policy": "delete"})
    with pytest.raises(BrokerError) as refused:
        await ensure_topics(settings)
    message = str(refused.value)
    assert settings.topics.inbox in message
    assert "5 partitions" in message and "expected 3" in message
    assert "DSH_PARTITIONS" in message


async def test_ensure_topics_refuses_a_compacted_session_events_topic(
        settings: Settings) -> None:
    await _create_topic(settings, settings.topics.session_events, 3,
                        {"cleanup.policy": "compact"})
    with pytest.raises(BrokerError, match=r"cleanup\.policy='compact', expected 'delete'"):
        await ensure_topics(settings)


async def test_ensure_topics_refuses_a_topic_below_the_record_limit(settings: Settings) -> None:
    await _create_topic(settings, settings.topics.spill, 3,
                        {"cleanup.policy": "compact", "max.message.bytes": "1048588"})
    with pytest.raises(BrokerError, match=r"max\.message\.bytes=1048588, below "
                                          r"DSH_MAX_RECORD_BYTES=8388608"):
        await ensure_topics(settings)


def test_plan_keeps_session_events_forever_and_co_partitions_inbox() -> None:
    specs = {s.name: s for s in plan_topics(Settings(topic_prefix="x.", partitions=12))}
    events, inbox = specs["x.session-events"], specs["x.inbox"]
    assert events.configs == {"cleanup.policy": "delete", "retention.ms": "-1",
                              "retention.bytes": "-1", "max.message.bytes": "8388608"}
    assert events.partitions == inbox.partitions == 12
    assert set(specs) == {"x.session-events", "x.inbox", "x.derived-messages", "x.usage",
                          "x.fleet", "x.spill", "x.session-events.dlq", "x.inbox.dlq",
                          "x.driver-checkpoints"}
    assert specs["x.spill"].cleanup_policy == "compact"
    assert specs["x.driver-checkpoints"].cleanup_policy == "compact"
    assert specs["x.driver-checkpoints"].partitions == 12
    assert {s.configs["max.message.bytes"] for s in specs.values()} == {"8388608"}


def test_client_options_reveal_the_sasl_password_only_in_the_options() -> None:
    settings = Settings(bootstrap_servers="b:9093", security_protocol="SASL_SSL",
                        sasl_mechanism="SCRAM-SHA-512", sasl_username="u",
                        sasl_password=Secret("hunter2"))
    options = client_options(settings)
    assert options["sasl_plain_password"] == "hunter2"
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert options["ssl_context"] is not None
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings.describe())


@pytest.mark.parametrize(("changes", "needle"), [
    ({"security_protocol": "TLS"}, "DSH_SECURITY_PROTOCOL"),
    ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "GSSAPI"}, "DSH_SASL_MECHANISM"),
    ({"security_protocol": "SASL_PLAINTEXT", "sasl_username": "u"}, "DSH_SASL_PASSWORD"),
    ({"bootstrap_servers": " "}, "DSH_BOOTSTRAP_SERVERS"),
])
def test_client_options_refuse_bad_security_settings(changes: dict[str, str],
                                                     needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        client_options(replace(Settings(), **changes))  # type: ignore[arg-type]


async def test_leaders_ready_reads_its_topic_alone_and_never_creates_it(
        settings: Settings) -> None:
    """A created topic has every partition's leader; a missing one is not ready, and the
    question does not create it (broker-side auto-creation)."""
    await ensure_topics(settings)
    assert await leaders_ready(settings, settings.topics.session_events)
    missing = settings.topic_prefix + "never-created"
    assert not await leaders_ready(settings, missing)
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        assert missing not in await admin.list_topics()
    finally:
        await admin.close()
