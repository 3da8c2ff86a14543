"""aiokafka's exceptions translated into the project's error tree: the one place that catches them.

Every other module wraps its broker calls in ``broker_errors(what)`` (or calls ``quietly`` for a
cleanup that must never raise) and sees only :class:`BrokerError`;
tests/adapters/test_kafka_errors.py checks that no other module of ``pipeline`` names an
aiokafka exception in an ``except`` clause or a ``suppress``.

Rules the translation keeps:

- the message is ``"<what>: <detail>"``: what was being done, then the aiokafka class name
  (operators search for it) and its text, or what an authorization refusal needs;
- it never contains a secret (aiokafka's texts carry none; settings are never formatted in);
- the original exception is the ``__cause__``, so :func:`is_transient` and :func:`is_fencing`
  can still tell the kind of failure apart.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    InvalidProducerEpoch,
    InvalidSessionTimeoutError,
    KafkaConnectionError,
    KafkaError,
    ProducerFenced,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    TransactionCoordinatorFenced,
)

from pipeline.core.errors import BrokerError

# What a broker call can raise besides aiokafka's own tree: the socket layer and timeouts.
_TRANSLATED: Final = (TimeoutError, KafkaError, OSError)
# Another producer with the same transactional id holds a newer epoch.
_FENCING: Final = (ProducerFenced, InvalidProducerEpoch, TransactionCoordinatorFenced)


def kafka_error(what: str, exc: BaseException, *, timeout_s: float | None = None) -> BrokerError:
    """A :class:`BrokerError` for ``exc`` raised while doing ``what`` (e.g. "create topics").

    ``timeout_s`` is the limit the caller gave the work, named when ``exc`` is a timeout.
    """
    if isinstance(exc, BrokerError):
        return exc
    if isinstance(exc, ProducerFenced):
        detail = "producer fenced: another producer with the same transactional id took over"
    elif (refused := _refusal(exc)) is not None:
        detail = refused
    elif isinstance(exc, InvalidSessionTimeoutError):
        detail = ("the brokers refuse this group session timeout: it must lie within their "
                  "group.min.session.timeout.ms and group.max.session.timeout.ms (Kafka's "
                  "default minimum is 6 s; the driver's default of 3 s needs 2 s, as the "
                  "project's broker configurations set): pass --session-timeout within them")
    elif isinstance(exc, TimeoutError):
        detail = (f"timed out after {timeout_s:.0f}s" if timeout_s is not None
                  else "timed out waiting for the broker")
    elif isinstance(exc, KafkaError | OSError):
        text = str(exc).strip()
        detail = type(exc).__name__ + (f": {text}" if text else "")
    else:
        detail = f"{type(exc).__name__}: {exc}"
    return BrokerError(f"{what}: {detail}")


@contextmanager
def broker_errors(what: str, *, timeout_s: float | None = None) -> Iterator[None]:
    """Translate aiokafka, socket and timeout errors raised inside the block into BrokerError.

    Usable around ``await`` too: ``with broker_errors("send"): await producer.send(...)``.
    """
    try:
        yield
    except BrokerError:
        raise
    except _TRANSLATED as exc:
        raise kafka_error(what, exc, timeout_s=timeout_s) from exc


@contextmanager
def quietly(what: str, log: logging.Logger) -> Iterator[None]:
    """For cleanup that never raises (stop, abort): a broker failure is logged at debug level.

    aiokafka also asserts its transaction state (AssertionError) when an abort or a stop comes
    after a fatal error; that is swallowed too.
    """
    try:
        yield
    except (*_TRANSLATED, AssertionError) as exc:
        log.debug("%s failed: %r", what, exc)


def is_transient(exc: BrokerError) -> bool:
    """Whether the failure under ``exc`` may pass by itself (aiokafka's ``retriable``)."""
    cause = exc.__cause__
    if isinstance(cause, KafkaError):
        return bool(cause.retriable)
    return isinstance(cause, OSError | TimeoutError)


def is_fencing(exc: BrokerError) -> bool:
    """Whether ``exc`` says a newer producer with the same transactional id took over."""
    return isinstance(exc.__cause__, _FENCING)


def is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is an authorization or authentication refusal (not transient)."""
    return isinstance(exc, tuple(kind for kind, _ in _REFUSALS))


# What an authorization error refuses (ACLs: docs/security.md); the text of the topic errors
# carries the topic names.
_REFUSALS: Final = (
    (TopicAuthorizationFailedError, "not authorized for topic {text} (needs Read to consume, "
                                    "Write to produce, Describe for metadata)"),
    (GroupAuthorizationFailedError, "not authorized for the consumer group (Group Read to "
                                    "consume, Describe to list or describe it)"),
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
