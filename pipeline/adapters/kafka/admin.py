"""The project's topics (DESIGN.md section 2): planned from settings, created idempotently, checked.

``ensure_topics(settings)`` creates what is missing and checks what exists. An existing topic
whose partition count or cleanup policy differs from the plan is refused with a
:class:`BrokerError` naming the topic, what was found, what was expected and what to do: a
compacted session-events topic would destroy logs, and a partition count that differs between
``session-events`` and ``inbox`` breaks co-partitioning (one writer per session).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    for_code,
)

from pipeline.adapters.kafka.errors import broker_errors, is_transient
from pipeline.adapters.kafka.options import client_options
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings

INFINITE: Final = "-1"
MAX_MESSAGE_BYTES: Final = "max.message.bytes"
MAX_COMPACTION_LAG: Final = "max.compaction.lag.ms"
# A record of a derived output is compacted at most this long after it was written: the
# broker rolls an output's active segment once it is that old (at its next write), which the
# cleaner never touches otherwise. See docs/operations.md, "Compacted outputs".
OUTPUT_MAX_COMPACTION_LAG_MS: Final = "60000"
ADMIN_TIMEOUT_MS: Final = 30_000
METADATA_WAIT_S: Final = 10.0
SERVICE_START_RETRY_S: Final = 120.0  # how long a starting service waits for the brokers

_Result = TypeVar("_Result")
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """One topic as the project needs it."""

    name: str
    partitions: int
    replication_factor: int
    configs: dict[str, str] = field(default_factory=dict)
    role: str = ""

    @property
    def cleanup_policy(self) -> str:
        return self.configs["cleanup.policy"]


@dataclass(frozen=True, slots=True)
class EnsureReport:
    """What :func:`ensure_topics` did: names created and names found already matching."""

    created: tuple[str, ...]
    existing: tuple[str, ...]
    # Topics this principal may neither see nor create (ACLs): left to the admin, unchecked.
    not_authorized: tuple[str, ...] = ()


def plan_topics(settings: Settings) -> list[TopicSpec]:
    """Every topic of the project for ``settings``, in creation order."""
    names = settings.topics
    parts, rf = settings.partitions, settings.replication_factor
    size = {MAX_MESSAGE_BYTES: str(settings.max_record_bytes)}
    keep_forever = {"cleanup.policy": "delete", "retention.ms": INFINITE,
                    "retention.bytes": INFINITE, **size}
    compact = {"cleanup.policy": "compact", **size}
    # Readers start from the outputs (snapshot, then live): what they read is one record
    # per key plus what the cleaner has not compacted yet, and this bounds the latter.
    output = {**compact, MAX_COMPACTION_LAG: OUTPUT_MAX_COMPACTION_LAG_MS}
    specs = [
        TopicSpec(names.session_events, parts, rf, dict(keep_forever), "source of truth"),
        TopicSpec(names.inbox, parts, rf, {"cleanup.policy": "delete", **size},
                  "co-partitioned with session-events"),
        TopicSpec(names.derived_messages, parts, rf, dict(output), "derived output"),
        TopicSpec(names.usage, parts, rf, dict(output), "derived output"),
        TopicSpec(names.fleet, parts, rf, dict(output), "derived output"),
        # Full texts of spilled tool results, in chunks keyed by content hash.
        TopicSpec(names.spill, parts, rf, dict(compact), "spilled content"),
        # Written in the driver's transactions, read at every takeover and wake-up: what
        # the cleaner has not compacted yet is read too, and this bounds it.
        TopicSpec(names.driver_checkpoints, parts, rf, dict(output),
                  "co-partitioned with session-events"),
    ]
    for source in (names.session_events, names.inbox):
        # Dead letters keep the original key and bytes; kept forever so nothing is lost.
        specs.append(TopicSpec(names.dlq(source), parts, rf, dict(keep_forever), "dead letters"))
    return specs


async def ensure_topics(settings: Settings, *, retry_for_s: float = 0.0) -> EnsureReport:
    """Create the project's missing topics and check the existing ones against the plan.

    Idempotent and safe to run from several processes at once. Raises :class:`BrokerError`
    when the broker cannot be used or an existing topic does not match the plan. A principal
    without Describe or Create on a topic (a service on a secured cluster, where the admin
    provisions the topics) skips it: it is reported in ``not_authorized``, not checked.
    ``retry_for_s``: for so long, a broker that cannot be reached or is not ready yet (a
    retriable error: a node restarting, a controller moving) is tried again with backoff, as
    a service starting beside a cluster needs; a refusal (a mismatched topic, an ACL) never.
    """
    return await retrying_transient(partial(_ensure_topics_once, settings), retry_for_s)


async def retrying_transient(call: Callable[[], Awaitable[_Result]], retry_for_s: float
                             ) -> _Result:
    """``call()``, tried again with backoff for ``retry_for_s`` while it raises a transient
    :class:`BrokerError` (a node restarting, a controller moving); any other error, or one
    past the budget, is raised."""
    deadline = time.monotonic() + retry_for_s
    delay_s = 0.5
    while True:
        try:
            return await call()
        except BrokerError as exc:
            if not is_transient(exc) or time.monotonic() + delay_s > deadline:
                raise
            log.warning("%s; trying again in %.1f s", exc, delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 5.0)


async def _ensure_topics_once(settings: Settings) -> EnsureReport:
    specs = plan_topics(settings)
    admin = AIOKafkaAdminClient(**client_options(settings), request_timeout_ms=ADMIN_TIMEOUT_MS)
    with broker_errors(f"connect to {settings.bootstrap_servers}"):
        await admin.start()
    try:
        found = await _partition_counts(admin, [s.name for s in specs])
        missing = [s for s in specs if s.name not in found]
        created, refused = await _create(admin, missing)
        specs = [s for s in specs if s.name not in refused]
        # created here or, meanwhile, by another process (TopicAlreadyExists): either way
        # the broker's metadata may lag the controller for a moment
        found.update(await _wait_visible(admin, [s.name for s in missing
                                                 if s.name not in refused]))
        configs = await _checked_configs(admin, [s.name for s in specs])
        for spec in specs:
            found_configs = configs.get(spec.name)
            if found_configs is None:
                refused.append(spec.name)  # visible, but its configs are not (no ACL)
                continue
            check_topic(spec, found.get(spec.name), found_configs.get("cleanup.policy", ""))
            check_record_limit(spec, found_configs.get(MAX_MESSAGE_BYTES))
    finally:
        await admin.close()
    existing = tuple(s.name for s in specs if s.name not in created and s.name not in refused)
    return EnsureReport(created=tuple(created), existing=existing,
                        not_authorized=tuple(refused))


def check_topic(spec: TopicSpec, partitions: int | None, cleanup_policy: str | None) -> None:
    """Refuse a topic whose partition count or cleanup policy differs from ``spec``."""
    if partitions is None:
        raise BrokerError(f"topic {spec.name!r} was created but is not visible in the metadata")
    if partitions != spec.partitions:
        raise BrokerError(
            f"topic {spec.name!r} ({spec.role}) has {partitions} partitions, expected "
            f"{spec.partitions} (DSH_PARTITIONS): session-events, inbox and the topics derived "
            "from them must share one partition count. Set DSH_PARTITIONS to match the existing "
            "topics, or use a new DSH_TOPIC_PREFIX; never repartition a live topic in place."
        )
    found_policy = sorted(p.strip() for p in (cleanup_policy or "").split(",") if p.strip())
    if found_policy != [spec.cleanup_policy]:
        raise BrokerError(
            f"topic {spec.name!r} ({spec.role}) has cleanup.policy="
            f"{cleanup_policy!r}, expected {spec.cleanup_policy!r}"
            + _policy_hint(spec)
        )


def check_record_limit(spec: TopicSpec, max_message_bytes: str | None) -> None:
    """Refuse a topic that would refuse records the project may write (below the limit)."""
    wanted = spec.configs.get(MAX_MESSAGE_BYTES)
    if wanted is None or max_message_bytes is None or int(max_message_bytes) >= int(wanted):
        return
    raise BrokerError(
        f"topic {spec.name!r} ({spec.role}) has {MAX_MESSAGE_BYTES}={max_message_bytes}, "
        f"below DSH_MAX_RECORD_BYTES={wanted}: records up to the limit would be refused. Set "
        f"it with kafka-configs --alter --topic {spec.name} --add-config "
        f"{MAX_MESSAGE_BYTES}={wanted}, or lower DSH_MAX_RECORD_BYTES.")


def _policy_hint(spec: TopicSpec) -> str:
    if spec.cleanup_policy == "delete":
        return (": compaction keeps only the last record per key and would destroy this data. "
                f"Set it with kafka-configs --alter --topic {spec.name} --add-config "
                "cleanup.policy=delete, or use a new DSH_TOPIC_PREFIX.")
    return (f": derived outputs keep the latest value per key. Set it with kafka-configs --alter "
            f"--topic {spec.name} --add-config cleanup.policy=compact.")


async def _partition_counts(admin: AIOKafkaAdminClient, names: Sequence[str], *,
                            led_only: bool = False) -> dict[str, int]:
    """Partition count of each topic in ``names`` that exists (with ``led_only``: and whose
    every partition has a leader, i.e. is ready for producers and offset look-ups).

    Lists first and describes only existing topics: aiokafka's metadata request for a named
    topic allows auto-creation, which would create a missing topic with the broker's defaults.
    """
    with broker_errors("list topics"):
        existing = set(await admin.list_topics()) & set(names)
    if not existing:
        return {}
    with broker_errors("describe topics"):
        described: list[dict[str, Any]] = await admin.describe_topics(sorted(existing))
    counts: dict[str, int] = {}
    for topic in described:
        led = all(p["leader"] >= 0 for p in topic["partitions"])
        if topic["error_code"] == 0 and (led or not led_only):
            counts[topic["topic"]] = len(topic["partitions"])
    return counts


async def _wait_visible(admin: AIOKafkaAdminClient, names: Sequence[str]) -> dict[str, int]:
    """Partition counts of ``names``, once the broker's metadata shows them all with a leader
    for every partition (it lags the controller for a moment after creation); whatever is
    visible when the wait ends."""
    deadline = time.monotonic() + METADATA_WAIT_S
    while time.monotonic() < deadline:
        counts = await _partition_counts(admin, names, led_only=True)
        if len(counts) == len(set(names)):
            return counts
        await asyncio.sleep(0.1)
    return await _partition_counts(admin, names)


async def _create(admin: AIOKafkaAdminClient, specs: Iterable[TopicSpec]
                  ) -> tuple[list[str], list[str]]:
    """Create ``specs``: (created, refused for lack of authorization); a topic created
    meanwhile by someone else is not an error."""
    new = [NewTopic(s.name, s.partitions, s.replication_factor, topic_configs=s.configs)
           for s in specs]
    if not new:
        return [], []
    with broker_errors("create topics"):
        response = await admin.create_topics(new, timeout_ms=ADMIN_TIMEOUT_MS)
    created: list[str] = []
    refused: list[str] = []
    for name, code, message in (tuple(e)[:3] for e in response.topic_errors):
        if code == 0:
            created.append(name)
        elif for_code(code) is TopicAuthorizationFailedError:
            refused.append(name)
        elif for_code(code) is not TopicAlreadyExistsError:
            raise BrokerError(
                f"create topic {name!r}: {for_code(code).__name__}"
                + (f": {message}" if message else "")
            )
    return created, refused


async def _checked_configs(admin: AIOKafkaAdminClient, names: Sequence[str]
                          ) -> dict[str, dict[str, str]]:
    """The effective ``cleanup.policy`` and ``max.message.bytes`` of each topic in ``names``."""
    wanted = {"cleanup.policy": None, MAX_MESSAGE_BYTES: None}
    resources = [ConfigResource(ConfigResourceType.TOPIC, n, wanted) for n in names]
    return await describe_topic_configs(admin, resources, skip_unauthorized=True)


async def describe_topic_configs(
    admin: AIOKafkaAdminClient, resources: Sequence[ConfigResource], *,
    skip_unauthorized: bool = False,
) -> dict[str, dict[str, str]]:
    """Topic name -> {config name: value} for ``resources`` (``configs=None``: every config).

    Retries briefly while the broker reports a just-created topic as unknown (its metadata
    lags the controller by a moment).
    """
    deadline = time.monotonic() + METADATA_WAIT_S
    while True:
        with broker_errors("describe topic configs"):
            responses = await admin.describe_configs(list(resources))
        result: dict[str, dict[str, str]] = {}
        failures: list[tuple[str, int, str]] = []
        for response in responses:
            for code, message, _type, name, entries in (tuple(r)[:5] for r in response.resources):
                if skip_unauthorized and for_code(code) is TopicAuthorizationFailedError:
                    continue  # no DescribeConfigs ACL: the caller leaves it unchecked
                if code != 0:
                    failures.append((name, code, message))
                result[name] = {str(e[0]): str(e[1]) for e in entries}
        if not failures:
            return result
        name, code, message = failures[0]
        if not for_code(code).retriable or time.monotonic() > deadline:
            raise BrokerError(f"describe configs of {name!r}: {for_code(code).__name__}"
                              + (f": {message}" if message else ""))
        await asyncio.sleep(0.1)


async def topic_configs(settings: Settings, topic: str) -> dict[str, str]:
    """Every effective config of ``topic`` (used by operators' checks and by tests)."""
    admin = AIOKafkaAdminClient(**client_options(settings), request_timeout_ms=ADMIN_TIMEOUT_MS)
    with broker_errors(f"connect to {settings.bootstrap_servers}"):
        await admin.start()
    try:
        resource = ConfigResource(ConfigResourceType.TOPIC, topic)
        return (await describe_topic_configs(admin, [resource])).get(topic, {})
    finally:
        await admin.close()
