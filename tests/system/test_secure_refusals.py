"""The secure stack refuses what a principal may not do, says who and what, and writes nothing.

One secure Kafka + registry for the module (the ``secure_stack`` session fixture). Each refusal
is checked for: the error naming the refused topic / operation (and, from the CLI, the
principal), no password in the message, and the target topic's end offsets unchanged.
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from secure_support import SecureStack

from dsh_dev.localstack.process import free_ports
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.adapters.registry.client import RegistryClient
from pipeline.adapters.secure.tls import make_pki
from pipeline.core.errors import BrokerError, RegistryError
from pipeline.settings import Secret

pytestmark = [pytest.mark.broker, pytest.mark.registry]
ROOT = Path(__file__).resolve().parents[2]


async def _ends(stack: SecureStack, topic: str) -> dict[int, int]:
    admin = stack.role("admin")
    consumer = AIOKafkaConsumer(**client_options(admin), group_id=None)
    await consumer.start()
    try:
        parts = range(stack.base.partitions)  # every project topic has this many
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in parts])
        return {tp.partition: int(o) for tp, o in ends.items()}
    finally:
        await consumer.stop()


def _refused_send(stack: SecureStack, role: str, topic: str, **changes: object) -> str:
    """Send one record to ``topic`` as ``role``: the refusal text (the topic stays as it was)."""
    settings = replace(stack.role(role), **changes)  # type: ignore[arg-type]
    before = asyncio.run(_ends(stack, topic))
    with pytest.raises(BrokerError) as refused:
        asyncio.run(send_records(settings, [OutRecord(topic, b"k", b"v")], timeout_s=20))
    assert asyncio.run(_ends(stack, topic)) == before, "a refused send wrote something"
    text = str(refused.value)
    for password in stack.passwords:
        assert password not in text
    return text


def test_an_allowed_send_goes_through(secure_stack: SecureStack) -> None:
    """The control: the ingest principal may post a command to the inbox."""
    topic = secure_stack.base.topics.inbox
    before = asyncio.run(_ends(secure_stack, topic))
    asyncio.run(send_records(secure_stack.role("ingest"), [OutRecord(topic, b"k", b"v")]))
    assert sum(asyncio.run(_ends(secure_stack, topic)).values()) == sum(before.values()) + 1


def test_a_wrong_password_is_refused(secure_stack: SecureStack) -> None:
    text = _refused_send(secure_stack, "ingest", secure_stack.base.topics.inbox,
                         sasl_password=Secret("not-the-password"))
    assert "SASL credentials" in text
    assert "not-the-password" not in text


def test_a_plaintext_client_on_the_tls_port_is_refused(secure_stack: SecureStack) -> None:
    text = _refused_send(secure_stack, "ingest", secure_stack.base.topics.inbox,
                         security_protocol="PLAINTEXT")
    assert "KafkaConnectionError" in text or "timed out" in text


def test_a_client_not_trusting_the_ca_is_refused(secure_stack: SecureStack,
                                                 tmp_path: Path) -> None:
    other = make_pki(tmp_path / "other-ca", common_name="not-the-stack-ca")
    text = _refused_send(secure_stack, "ingest", secure_stack.base.topics.inbox,
                         ssl_cafile=str(other.ca_file))
    assert "KafkaConnectionError" in text


def test_the_processors_principal_cannot_write_the_inbox(secure_stack: SecureStack) -> None:
    inbox = secure_stack.base.topics.inbox
    text = _refused_send(secure_stack, "processors", inbox)
    assert "TopicAuthorizationFailedError" in text and repr(inbox) in text


@pytest.mark.parametrize("name", ["inbox", "session_events", "derived_messages", "fleet"])
def test_the_dashboard_principal_cannot_write_anything(secure_stack: SecureStack,
                                                       name: str) -> None:
    text = _refused_send(secure_stack, "dashboard", getattr(secure_stack.base.topics, name))
    assert "AuthorizationFailedError" in text


def test_the_ingest_principal_cannot_write_an_output_topic(secure_stack: SecureStack) -> None:
    derived = secure_stack.base.topics.derived_messages
    text = _refused_send(secure_stack, "ingest", derived)
    assert "TopicAuthorizationFailedError" in text and repr(derived) in text


def test_a_driver_transactional_id_outside_its_prefix_is_refused(
        secure_stack: SecureStack) -> None:
    async def start() -> None:
        producer = PartitionProducer(secure_stack.role("driver"), group_id="someone-else",
                                     partition=0)
        try:
            await producer.start()
        finally:
            await producer.close()

    with pytest.raises(BrokerError) as refused:
        asyncio.run(start())
    assert "TransactionalIdAuthorizationFailed" in str(refused.value)
    assert "someone-else-driver-p0" in str(refused.value)


def test_the_driver_keeps_its_own_transactional_ids(secure_stack: SecureStack) -> None:
    """The control of the test above: the driver's own group's ids are allowed."""
    async def start() -> None:
        settings = secure_stack.role("driver")
        producer = PartitionProducer(settings, group_id=f"{settings.group_id_prefix}driver",
                                     partition=1)
        await producer.start()
        await producer.close()

    asyncio.run(start())


def test_registry_writes_need_the_admin(secure_stack: SecureStack) -> None:
    url = secure_stack.role("admin").registry_url
    ca = str(secure_stack.security.pki.ca_file)
    subject = "sec.refused-subject-value"
    schema = {"schema": '{"type":"string"}', "schemaType": "AVRO"}
    with httpx.Client(verify=ssl.create_default_context(cafile=ca)) as http:
        anonymous = http.post(f"{url}/subjects/{subject}/versions", json=schema)
        assert anonymous.status_code == 401
    reader = RegistryClient.from_settings(secure_stack.role("dashboard"))
    with reader, pytest.raises(RegistryError) as refused:
        reader.register(subject, '{"type":"string"}')
    assert "HTTP 403" in str(refused.value)
    assert secure_stack.password("dashboard") not in str(refused.value)
    with RegistryClient.from_settings(secure_stack.role("admin")) as admin:
        assert subject not in admin.subjects()
    with httpx.Client() as http, pytest.raises(httpx.HTTPError):
        http.get(url.replace("https://", "http://") + "/subjects", timeout=5)


def test_a_refused_command_exits_non_zero_naming_the_principal(
        secure_stack: SecureStack) -> None:
    inbox = secure_stack.base.topics.inbox
    before = asyncio.run(_ends(secure_stack, inbox))
    env = secure_stack.env("processors")
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "send", "s-1",
                           "--followup", "hello"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "User:processors" in done.stderr and repr(inbox) in done.stderr, done.stderr
    for password in secure_stack.passwords:
        assert password not in done.stderr + done.stdout
    assert asyncio.run(_ends(secure_stack, inbox)) == before


@pytest.mark.parametrize(("command", "role"), [
    (["driver", "--metrics-port", "0"], "dashboard"),
    (["processors", "--web-port", str(free_ports(1)[0])], "dashboard"),
])
def test_a_service_refused_at_start_exits_non_zero_saying_why(
        secure_stack: SecureStack, tmp_path: Path, command: list[str], role: str) -> None:
    """A service started as a principal without its ACLs stops at once, naming the principal
    and what was refused; it does not retry for ever."""
    env = {**secure_stack.env(role), "DSH_STATE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", *command], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    said = done.stdout + done.stderr
    assert done.returncode != 0, said[-3000:]
    assert f"User:{role}" in said and "AuthorizationFailed" in said, said[-3000:]
    for password in secure_stack.passwords:
        assert password not in said
