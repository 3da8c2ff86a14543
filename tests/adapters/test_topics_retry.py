"""A starting service waits for brokers that are not reachable yet (``retry_for_s``), and
gives up at once on a refusal; the chaos campaign's services exited when a broker was down."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket

import pytest
from aiokafka.errors import KafkaConnectionError, NodeNotReadyError, TopicAuthorizationFailedError

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.errors import is_transient
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings


def broker_error(cause: BaseException | None) -> BrokerError:
    error = BrokerError("create topics: failed")
    error.__cause__ = cause
    return error


def test_only_retriable_broker_failures_are_transient() -> None:
    assert is_transient(broker_error(NodeNotReadyError()))
    assert is_transient(broker_error(KafkaConnectionError("Unable to bootstrap")))
    assert is_transient(broker_error(ConnectionRefusedError()))
    assert not is_transient(broker_error(TopicAuthorizationFailedError()))
    assert not is_transient(broker_error(None))  # e.g. a topic with another partition count


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def forward(target: tuple[str, int], reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    """One connection relayed to ``target`` both ways."""
    up_reader, up_writer = await asyncio.open_connection(*target)

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@pytest.mark.timeout(420)
async def test_a_service_start_waits_for_a_broker_that_comes_up(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pipeline.adapters.kafka.admin")
    host, port = settings.bootstrap_servers.split(":")
    late = free_port()  # nothing listens there yet: the bootstrap is refused
    waiting = dataclasses.replace(settings, bootstrap_servers=f"127.0.0.1:{late}")
    ensuring = asyncio.create_task(ensure_topics(waiting, retry_for_s=120))
    await asyncio.sleep(2.0)
    assert not ensuring.done()  # still trying, not failed
    assert "trying again" in caplog.text
    server = await asyncio.start_server(
        lambda r, w: forward((host, int(port)), r, w), "127.0.0.1", late)
    try:
        report = await asyncio.wait_for(ensuring, 90)
    finally:
        server.close()
    assert settings.topics.session_events in report.created


async def test_without_a_retry_budget_an_unreachable_broker_fails_without_retrying(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pipeline.adapters.kafka.admin")
    with pytest.raises(BrokerError, match="connect to"):
        await ensure_topics(Settings(bootstrap_servers=f"127.0.0.1:{free_port()}"))
    assert "trying again" not in caplog.text
