"""Send an approval decision, then read what came of it (``send --approve/--deny --wait``).

The driver answers a decision in the session log only: ``dsh-pipeline/approval`` when it
took it, ``dsh-pipeline/approval-refused`` (with the reason, e.g. another person's decision
came first) when it did not. With ``--wait`` the command reads the session's partition of
the session topic (read committed), from its end taken before the decision was sent, until
one of them carries the decision's message id.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.avro import EventSerde
from pipeline.codec.records import HEADER_TYPE
from pipeline.core.approvals import DECISION_TYPE, REFUSED_TYPE
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings

_ANSWERS = {DECISION_TYPE.encode(), REFUSED_TYPE.encode()}


async def send_and_wait(settings: Settings, record: OutRecord, session_id: str,
                        message_id: str, timeout_s: float) -> tuple[int, int, dict[str, Any]]:
    """Send ``record``; ``(partition, offset, answer)``: ``answer`` is the data of the
    event that answered it, with ``type``. Raises BrokerError when none came in time."""
    tp = TopicPartition(settings.topics.session_events,
                        partition_for(session_id, settings.partitions))
    consumer = AIOKafkaConsumer(**client_options(settings), enable_auto_commit=False,
                                isolation_level="read_committed")
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)  # the end before the decision is sent
        [(partition, offset)] = await send_records(settings, [record])
        answer = await _answer(consumer, tp, session_id, message_id, timeout_s)
    finally:
        await consumer.stop()
    return partition, offset, answer


async def _answer(consumer: AIOKafkaConsumer, tp: TopicPartition, session_id: str,
                  message_id: str, timeout_s: float) -> dict[str, Any]:
    serde, key = EventSerde(), session_id.encode("utf-8")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batches = await consumer.getmany(tp, timeout_ms=500)
        for message in batches.get(tp, []):
            kind = dict(message.headers or ()).get(HEADER_TYPE)
            if message.key != key or kind not in _ANSWERS or message.value is None:
                continue
            _, event = serde.decode(message.value)
            data = event.data
            if isinstance(data, Mapping) and data.get("messageId") == message_id:
                return {"type": event.type, **data}
    raise BrokerError(f"no answer to decision {message_id!r} in the session log within "
                      f"{timeout_s:g} s (is a driver running?)")
