"""Kafka adapters: everything that talks to brokers through aiokafka.

- :mod:`.options`: ``client_options(settings)`` for every aiokafka client (bootstrap, SASL,
  TLS) and ``broker_errors``/``kafka_error``, which translate aiokafka errors to BrokerError.
- :mod:`.admin`: the project's topics, ``ensure_topics(settings)``.

Producers, consumers, transactions and dead letters live in the sibling modules.
"""
