"""aiokafka client options from :class:`Settings`, and aiokafka errors mapped into the error tree.

``client_options(settings)`` is the one place that turns the broker settings (bootstrap servers,
security protocol, SASL, TLS) into keyword arguments for ``AIOKafkaProducer``,
``AIOKafkaConsumer`` and ``AIOKafkaAdminClient``; it is also the only place where the SASL
password is revealed. ``kafka_error(what, exc)`` and the ``broker_errors(what)`` context
manager translate aiokafka's (and the socket layer's) exceptions into :class:`BrokerError`,
naming what was being done; the error text never contains a secret.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    KafkaError,
    ProducerFenced,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)

from pipeline.core.errors import BrokerError, ConfigError
from pipeline.settings import Settings

SECURITY_PROTOCOLS: Final = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS: Final = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def client_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments shared by every aiokafka client built from ``settings``.

    Raises :class:`ConfigError` for an unknown security protocol or SASL mechanism, a SASL
    protocol without credentials, or an unreadable CA file.
    """
    protocol = settings.security_protocol.upper()
    if protocol not in SECURITY_PROTOCOLS:
        raise ConfigError(
            f"DSH_SECURITY_PROTOCOL must be one of {', '.join(SECURITY_PROTOCOLS)}, "
            f"got {settings.security_protocol!r}"
        )
    if not settings.bootstrap_servers.strip():
        raise ConfigError("DSH_BOOTSTRAP_SERVERS is empty: give host:port[,host:port...]")
    options: dict[str, Any] = {
        "bootstrap_servers": settings.bootstrap_servers,
        "security_protocol": protocol,
    }
    if protocol.startswith("SASL_"):
        options.update(_sasl_options(settings))
    if protocol.endswith("SSL"):
        options["ssl_context"] = _ssl_context(settings.ssl_cafile)
    return options


# aiokafka's own default: one fetch response carries up to this much over all partitions.
FETCH_MAX_BYTES: Final = 50 * 1024 * 1024


def producer_size_options(settings: Settings) -> dict[str, Any]:
    """Producer options that follow the one record limit (``DSH_MAX_RECORD_BYTES``)."""
    return {"max_request_size": settings.max_record_bytes}


def consumer_size_options(settings: Settings) -> dict[str, Any]:
    """Consumer options that follow the one record limit: a partition's fetch can always
    carry the largest record a topic accepts."""
    return {"max_partition_fetch_bytes": settings.max_record_bytes,
            "fetch_max_bytes": max(FETCH_MAX_BYTES, settings.max_record_bytes)}


def _sasl_options(settings: Settings) -> dict[str, Any]:
    mechanism = (settings.sasl_mechanism or "PLAIN").upper()
    if mechanism not in SASL_MECHANISMS:
        raise ConfigError(
            f"DSH_SASL_MECHANISM must be one of {', '.join(SASL_MECHANISMS)}, "
            f"got {settings.sasl_mechanism!r}"
        )
    if not settings.sasl_username or not settings.sasl_password:
        raise ConfigError(
            f"DSH_SECURITY_PROTOCOL={settings.security_protocol} needs DSH_SASL_USERNAME "
            "and DSH_SASL_PASSWORD"
        )
    return {
        "sasl_mechanism": mechanism,
        "sasl_plain_username": settings.sasl_username,
        "sasl_plain_password": settings.sasl_password.reveal(),
    }


def _ssl_context(cafile: str) -> ssl.SSLContext:
    """A verifying TLS context: the system CAs, or only ``cafile`` when it is given."""
    try:
        return ssl.create_default_context(cafile=cafile or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"DSH_SSL_CAFILE {cafile!r} cannot be used: {exc}") from None


def kafka_error(what: str, exc: BaseException) -> BrokerError:
    """A :class:`BrokerError` for ``exc`` raised while doing ``what`` (e.g. "create topics").

    Keeps the aiokafka class name (operators search for it) and says when a producer was fenced.
    """
    if isinstance(exc, BrokerError):
        return exc
    if isinstance(exc, ProducerFenced):
        detail = "producer fenced: another producer with the same transactional id took over"
    elif (refused := _refusal(exc)) is not None:
        detail = refused
    elif isinstance(exc, TimeoutError):
        detail = "timed out waiting for the broker"
    elif isinstance(exc, KafkaError | OSError):
        text = str(exc).strip()
        detail = type(exc).__name__ + (f": {text}" if text else "")
    else:
        detail = f"{type(exc).__name__}: {exc}"
    return BrokerError(f"{what}: {detail}")


# What an authorization error refuses (ACLs: docs/security.md); the text of the topic errors
# carries the topic names.
_REFUSALS: Final = (
    (TopicAuthorizationFailedError, "not authorized for topic {text} (needs Read to consume, "
                                    "Write to produce, Describe for metadata)"),
    (GroupAuthorizationFailedError, "not authorized for the consumer group (Group Read)"),
    (TransactionalIdAuthorizationFailed, "not authorized for its transactional id "
                                         "(TransactionalId Write)"),
    (ClusterAuthorizationFailedError, "not authorized on the cluster (a producer needs Write "
                                      "on some topic, or IdempotentWrite)"),
    (SaslAuthenticationFailed, "authentication failed: wrong user name or password, or "
                               "mechanism"),
)


def _refusal(exc: BaseException) -> str | None:
    for kind, template in _REFUSALS:
        if isinstance(exc, kind):
            text = str(exc).split(":")[-1].strip() if ":" in str(exc) else ""
            return f"{type(exc).__name__}: " + template.format(text=repr(text) if text else
                                                                 "(name not given)")
    if isinstance(exc, KafkaConnectionError):
        return (f"{type(exc).__name__}: {str(exc).strip()} (no broker accepted the connection: "
                "check the address, the security protocol, DSH_SSL_CAFILE and the SASL "
                "credentials)")
    return None


def is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is an authorization or authentication refusal (not transient)."""
    return isinstance(exc, tuple(kind for kind, _ in _REFUSALS))


@contextmanager
def broker_errors(what: str) -> Iterator[None]:
    """Translate aiokafka, socket and timeout errors raised inside the block into BrokerError.

    Usable around ``await`` too: ``with broker_errors("send"): await producer.send(...)``.
    """
    try:
        yield
    except BrokerError:
        raise
    except (TimeoutError, KafkaError, OSError) as exc:
        raise kafka_error(what, exc) from exc
