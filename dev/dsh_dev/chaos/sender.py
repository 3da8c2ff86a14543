"""A long-lived idempotent producer (acks=all) that returns where each record landed.

The campaign's load and garbage go through it: each send waits for the acknowledgement and
returns ``(partition, offset)``, so every command and every garbage record is known by its
offset when the invariants are checked. Records are keyed, so the default partitioner keeps
the inbox and the session topic co-partitioned, as ``dsh-pipeline send`` does.
"""

from __future__ import annotations

import asyncio
from typing import Final

from aiokafka import AIOKafkaProducer

from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options
from pipeline.settings import Settings

SEND_TIMEOUT_S: Final = 60.0


class Sender:
    """``await start()``, ``await send(...)`` per record, ``await stop()``."""

    def __init__(self, settings: Settings) -> None:
        self._producer = AIOKafkaProducer(**client_options(settings), enable_idempotence=True,
                                          acks="all", linger_ms=5)
        self._started = False

    async def start(self) -> None:
        with broker_errors("chaos sender: connect", timeout_s=SEND_TIMEOUT_S):
            await asyncio.wait_for(self._producer.start(), SEND_TIMEOUT_S)
        self._started = True

    async def stop(self) -> None:
        if self._started:
            self._started = False
            await self._producer.stop()

    async def send(self, topic: str, key: bytes, value: bytes) -> tuple[int, int]:
        """Send one record and wait for it to be acknowledged by the in-sync replicas."""
        with broker_errors(f"chaos sender: send to {topic}", timeout_s=SEND_TIMEOUT_S):
            future = await self._producer.send(topic, value, key=key)
            meta = await asyncio.wait_for(future, SEND_TIMEOUT_S)
        return meta.partition, meta.offset
