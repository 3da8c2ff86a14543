"""aiokafka client options from :class:`Settings`.

``client_options(settings)`` is the one place that turns the broker settings (bootstrap servers,
security protocol, SASL, TLS) into keyword arguments for ``AIOKafkaProducer``,
``AIOKafkaConsumer`` and ``AIOKafkaAdminClient``; it is also the only place where the SASL
password is revealed. aiokafka's exceptions are translated in :mod:`.errors`.
"""

from __future__ import annotations

import ssl
from typing import Any, Final

from pipeline.core.errors import ConfigError
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
