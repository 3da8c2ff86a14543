"""The local stack: Apache Kafka and Apicurio Registry from Maven Central, run with ``java``.

- :mod:`.artifacts`: resolve the jars into the ignored cache (``ensure_artifacts``).
- :mod:`.kafka`: ``KafkaLocal``, one combined KRaft node or a 3-node cluster.
- :mod:`.registry`: ``RegistryLocal``, Apicurio with in-memory storage.
- :mod:`.stack`: ``LocalStack``, both together (the ``broker`` and ``demo`` commands).
- :mod:`.process`: child processes that never outlive their Python parent.
"""
