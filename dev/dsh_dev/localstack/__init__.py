"""The local stack: Apache Kafka and Apicurio Registry from Maven Central, run with ``java``.

- :mod:`.artifacts`: resolve the jars into the cache (``ensure_artifacts``; the cache is
  :func:`dsh_dev.localstack.artifacts.default_cache_dir`).
- :mod:`.kafka`: ``KafkaLocal``, one combined KRaft node or a 3-node cluster.
- :mod:`.registry`: ``RegistryLocal``, Apicurio with in-memory storage.
- :mod:`.stack`: ``LocalStack``, both together (the ``broker`` and ``demo`` commands).
- :mod:`.process`: child processes that never outlive their Python parent.
- :mod:`.acl_tool`: Kafka's ``kafka-acls`` over the ACL plan of
  :mod:`pipeline.adapters.secure.acls`.
- ``files/``: the Maven POMs, the broker's properties template, its logging configuration and
  the ACL batch tool (package data).

The certificates, principals, ACL plan and compose secrets of a secure deployment are the
product's (:mod:`pipeline.adapters.secure`: ``dsh-pipeline certs``); this package runs them.
"""
