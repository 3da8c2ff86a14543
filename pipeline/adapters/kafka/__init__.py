"""Kafka adapters: everything that talks to brokers through aiokafka.

- :mod:`.options`: ``client_options(settings)`` for every aiokafka client (bootstrap, SASL,
  TLS).
- :mod:`.errors`: ``broker_errors``/``kafka_error``, the one translation of aiokafka's
  exceptions into BrokerError (no other module catches them).
- :mod:`.admin`: the project's topics, ``ensure_topics(settings)``.

Producers, consumers, transactions and dead letters live in the sibling modules.
"""
