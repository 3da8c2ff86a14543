"""The whole local stack: Kafka (1 or 3 nodes) and the Apicurio registry, started together.

Both JVMs are launched first and waited for afterwards, so their start-ups overlap. Used by
``dsh-pipeline broker`` and ``dsh-pipeline demo``; the test fixtures use the two parts
separately (:mod:`.kafka`, :mod:`.registry`) so that a run needing only Kafka starts only Kafka.

With ``security`` (a :class:`SecureSetup`) both run secured, and once Kafka answers the ACLs of
``acl_rules`` are created (:mod:`.acls`) before ``start()`` returns, then the env files of every
role are written.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType

from dsh_dev.localstack.acl_tool import apply_acls
from dsh_dev.localstack.artifacts import Artifacts
from dsh_dev.localstack.kafka import READY_BUDGET_S, KafkaLocal
from dsh_dev.localstack.process import find_java
from dsh_dev.localstack.registry import RegistryLocal
from pipeline.adapters.secure.acls import AclRule
from pipeline.adapters.secure.security import SecureSetup


class LocalStack:
    """Kafka plus registry; ``start()`` returns once both answer, ``stop()`` stops both."""

    def __init__(self, artifacts: Artifacts, *, nodes: int = 1, kafka_port: int | None = None,
                 registry_port: int | None = None, with_registry: bool = True,
                 workdir: Path | None = None, security: SecureSetup | None = None,
                 acl_rules: list[AclRule] | None = None) -> None:
        kafka_dir = workdir / "kafka" if workdir else None
        registry_dir = workdir / "registry" if workdir else None
        self.kafka = KafkaLocal(artifacts.require_kafka(), kafka_dir, nodes=nodes,
                                port=kafka_port, security=security)
        self.registry = (RegistryLocal(artifacts.require_apicurio(), registry_dir,
                                       port=registry_port, security=security)
                         if with_registry else None)
        self.security = security
        self._acl_rules = acl_rules or []
        self._acl_classpath = (f"{artifacts.kafka_lib}/*:{artifacts.require_acl_tool()}/*"
                               if security else "")
        self.started_s = 0.0
        self.acl_runs = 0

    @property
    def bootstrap(self) -> str:
        return self.kafka.bootstrap

    @property
    def registry_url(self) -> str:
        return self.registry.url if self.registry else ""

    def start(self, budget_s: float = READY_BUDGET_S) -> None:
        """Launch both, wait for both; on failure stop what was started and re-raise."""
        began = time.monotonic()
        try:
            if self.registry:
                self.registry.launch()
            self.kafka.launch()
            self.kafka.wait_ready(budget_s)
            if self.security is not None:
                self.security.write_client_files(self.bootstrap, self.registry_url)
                self.acl_runs = apply_acls(find_java(17), self._acl_classpath, self.bootstrap,
                                           self.security.admin_properties, self._acl_rules)
            if self.registry:
                self.registry.wait_ready(budget_s)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - began

    def change_acls(self, rules: list[AclRule], *, remove: bool = False) -> None:
        """Add (or remove) ACLs on the running secure stack (the admin's kafka-acls)."""
        if self.security is None:
            raise ValueError("ACLs exist only on a secure stack")
        apply_acls(find_java(17), self._acl_classpath, self.bootstrap,
                   self.security.admin_properties, rules, remove=remove)

    def dead_processes(self) -> list[tuple[str, Path]]:
        """(name, log file) of each started process that has exited on its own."""
        dead = [(f"kafka node {n.node_id}", n.log_path) for n in self.kafka.dead_nodes()]
        if self.registry is not None and not self.registry.alive():
            dead.append(("apicurio registry", self.registry.log_path))
        return dead

    def stop(self) -> None:
        self.kafka.stop()
        if self.registry:
            self.registry.stop()

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
