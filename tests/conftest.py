"""Shared fixtures: one real local Kafka and one real Apicurio registry per pytest session.

- ``kafka_bootstrap`` (session): "127.0.0.1:PORT" of a single-node KRaft broker started by
  :mod:`dsh_dev.localstack`, or ``$DSH_TEST_BOOTSTRAP`` when set.
- ``registry_url`` (session): the registry's ccompat v7 base URL
  ("http://127.0.0.1:PORT/apis/ccompat/v7", global compatibility BACKWARD_TRANSITIVE), or
  ``$DSH_TEST_REGISTRY_URL`` when set.
- ``topic_prefix`` (function): a unique prefix such as "t1a2b3c4d5e6.", so tests never share
  topics.
- ``group_id`` (function): a unique consumer group id.
- ``settings`` (function): ``Settings`` with that prefix, 3 partitions, replication factor 1,
  the fixture broker and the fixture registry.
- ``topics`` (function): the driver tests' settings, as ``settings`` without the registry,
  once their topics exist (tests/support/driver_topics.py).
- ``shared_cluster`` (session): a 3-node cluster for the tests that kill none of its nodes;
  they run one after the other, and it stops after the last of them (``cluster``, module
  scoped, is a cluster of the module's own).

Tests using ``kafka_bootstrap`` or ``settings`` get the ``broker`` marker automatically, those
using ``registry_url`` or ``settings`` the ``registry`` marker, those using ``cluster`` or
``shared_cluster`` the ``cluster`` and ``jars`` markers, those using ``secure_stack``
``broker``, ``registry`` and ``jars``. A test that runs Java itself carries ``jars`` (checked:
one that starts a Java program without it, or without a marker of a tier that runs Java
anyway, fails saying so). ``make check`` runs the unit tier: every test without ``broker``,
``registry``, ``cluster``, ``jars``, ``browser`` or ``promtool`` (the Makefile's
``UNIT_MARKERS``). The Java artifacts are resolved by ``make setup``, never here: a fixture
that finds them missing fails with the command to run.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys
import uuid
from collections.abc import Generator, Iterator
from typing import Any

import hypothesis.internal.observability  # noqa: F401  (imported at the summary otherwise)
import pytest

from dsh_dev.localstack.artifacts import Artifacts
from dsh_dev.localstack.kafka import KafkaLocal
from dsh_dev.localstack.registry import RegistryLocal
from pipeline.cli.main import commands
from pipeline.settings import Settings

# CPython 3.11.7 (this machine's) races when two threads compile at once
# (python/cpython#106905: "AST constructor recursion depth mismatch"). The CLI imports its
# command's module lazily, and tests run it in threads (asyncio.to_thread), so every command
# module is imported here, once, before any test runs.
for _module in sorted({module for module, _summary in commands().values()}):
    importlib.import_module(_module)

TEST_PARTITIONS = 3
# Generous: a loaded 2-core machine can take well over the 60 s the CLI allows.
READY_BUDGET_S = 300.0
KAFKA_FIXTURES = frozenset({"kafka_bootstrap", "settings", "secure_stack"})
REGISTRY_FIXTURES = frozenset({"registry_url", "settings", "secure_stack"})
SHARED_CLUSTER = "shared_cluster"
CLUSTER_FIXTURES = frozenset({"cluster", SHARED_CLUSTER})
JARS_FIXTURES = frozenset({"cluster", SHARED_CLUSTER, "secure_stack"})
# The markers of the tiers that run Java: a test that starts a Java program carries one.
JAVA_MARKERS = ("jars", "broker", "registry", "cluster")


class _LocalServices:
    """Starts Kafka and the registry on first use, once per session; stops them at the end.

    When the collected tests need both, the registry is launched together with Kafka so the
    two JVM start-ups overlap.
    """

    def __init__(self, registry_wanted: bool) -> None:
        self.registry_wanted = registry_wanted
        self.artifacts = Artifacts.default()
        self._kafka: KafkaLocal | None = None
        self._registry: RegistryLocal | None = None
        self._registry_ready = False

    def kafka_bootstrap(self) -> str:
        if self._kafka is None:
            # 1 GiB: a whole run creates thousands of topics (512 MiB ran out of heap once)
            kafka = KafkaLocal(self.artifacts.require_kafka(), heap_mb=1024)
            self._kafka = kafka
            if self.registry_wanted and os.environ.get("DSH_TEST_REGISTRY_URL") is None:
                self._launch_registry()
            kafka.start(budget_s=READY_BUDGET_S)
        return self._kafka.bootstrap

    def registry_url(self) -> str:
        if self._registry is None:
            self._launch_registry()
        assert self._registry is not None
        if not self._registry_ready:
            self._registry.wait_ready(budget_s=READY_BUDGET_S)
            self._registry_ready = True
        return self._registry.url

    def _launch_registry(self) -> None:
        registry = RegistryLocal(self.artifacts.require_apicurio(), heap_mb=384)
        self._registry = registry
        registry.launch()

    def stop(self) -> None:
        if self._kafka is not None:
            self._kafka.stop()
        if self._registry is not None:
            self._registry.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    registry_wanted = False
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & KAFKA_FIXTURES:
            item.add_marker(pytest.mark.broker)
        if names & CLUSTER_FIXTURES:
            item.add_marker(pytest.mark.cluster)
        if names & JARS_FIXTURES:
            item.add_marker(pytest.mark.jars)
        if names & REGISTRY_FIXTURES or item.get_closest_marker("registry"):
            item.add_marker(pytest.mark.registry)
            registry_wanted = True
    config.stash[_REGISTRY_WANTED] = registry_wanted


_REGISTRY_WANTED = pytest.StashKey[bool]()


class _SharedCluster:
    """The session's shared 3-node cluster: started on first use, stopped once the last of
    its ``users`` (the collected tests using it) is torn down, or at the session's end."""

    def __init__(self) -> None:
        self.users = 0
        self._kafka: KafkaLocal | None = None

    def get(self) -> KafkaLocal:
        if self._kafka is None:
            self._kafka = KafkaLocal(Artifacts.default().require_kafka(), nodes=3, heap_mb=384)
            self._kafka.start(budget_s=READY_BUDGET_S)
        return self._kafka

    def release(self) -> None:
        """One user is done; after the last one the cluster stops."""
        self.users -= 1
        if self.users <= 0:
            self.stop()

    def stop(self) -> None:
        if self._kafka is not None:
            self._kafka.stop()
            self._kafka = None


_SHARED_CLUSTER = pytest.StashKey[_SharedCluster]()


def _shared_cluster(config: pytest.Config) -> _SharedCluster:
    return config.stash.setdefault(_SHARED_CLUSTER, _SharedCluster())


def _uses_shared_cluster(item: pytest.Item) -> bool:
    return SHARED_CLUSTER in getattr(item, "fixturenames", ())


def pytest_collection_finish(session: pytest.Session) -> None:
    """The tests using the shared cluster run one after the other, where the first of them
    was (the order is otherwise kept), so that the cluster runs only while they do."""
    users = [item for item in session.items if _uses_shared_cluster(item)]
    _shared_cluster(session.config).users = len(users)
    if users:
        first = session.items.index(users[0])
        others = [item for item in session.items if not _uses_shared_cluster(item)]
        session.items[:] = [*others[:first], *users, *others[first:]]


# --- every test that runs Java says so ----------------------------------------------------
# An audit hook sees each process this one starts; ``java -version`` (a probe: find_java) is
# not a Java program. Processes that children start are not seen: the commands that start the
# local stack are run by tests marked for it.
_java_started: list[str] = []


def _on_audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "subprocess.Popen":
        argv = [str(a) for a in (args[1] if isinstance(args[1], list | tuple) else [args[1]])]
        if argv and pathlib.Path(argv[0]).name == "java" and "-version" not in argv:
            _java_started.append(" ".join(argv)[:160])


sys.addaudithook(_on_audit)


def _java_unmarked(item: pytest.Item) -> Generator[None, None, None]:
    _java_started.clear()
    yield
    if _java_started and not any(item.get_closest_marker(m) for m in JAVA_MARKERS):
        started = _java_started[0]
        _java_started.clear()
        pytest.fail(f"this test started Java ({started}) but carries none of the markers "
                    f"{', '.join(JAVA_MARKERS)}: mark it `@pytest.mark.jars` so that the unit "
                    "tier (`make check`) leaves it out", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _java_unmarked(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _java_unmarked(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    finally:
        if _uses_shared_cluster(item):
            _shared_cluster(item.config).release()


@pytest.fixture(scope="session")
def _local_services(pytestconfig: pytest.Config) -> Iterator[_LocalServices]:
    services = _LocalServices(pytestconfig.stash.get(_REGISTRY_WANTED, False))
    try:
        yield services
    finally:
        services.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(_local_services: _LocalServices) -> str:
    """host:port of the session's Kafka broker."""
    external = os.environ.get("DSH_TEST_BOOTSTRAP", "").strip()
    return external or _local_services.kafka_bootstrap()


@pytest.fixture(scope="session")
def registry_url(_local_services: _LocalServices) -> str:
    """ccompat v7 base URL of the session's schema registry."""
    external = os.environ.get("DSH_TEST_REGISTRY_URL", "").strip()
    return external.rstrip("/") if external else _local_services.registry_url()


@pytest.fixture(scope="module")
def cluster() -> Iterator[KafkaLocal]:
    """A 3-node cluster of the module's own (the tests that use it kill and restart nodes)."""
    kafka = KafkaLocal(Artifacts.default().require_kafka(), nodes=3, heap_mb=384)
    try:
        kafka.start(budget_s=300)
        yield kafka
    finally:
        kafka.stop()


@pytest.fixture(scope="session")
def shared_cluster(pytestconfig: pytest.Config) -> Iterator[KafkaLocal]:
    """A 3-node cluster (replication 3, min ISR 2) shared by the tests that kill none of its
    nodes (each on topics and groups of its own); they run one after the other, and the
    cluster stops after the last of them."""
    shared = _shared_cluster(pytestconfig)
    try:
        yield shared.get()
    finally:
        shared.stop()


@pytest.fixture(scope="session")
def secure_stack() -> Iterator[object]:
    """A secure Kafka + registry of its own (tests/support/secure_support.py), started on
    first use."""
    from secure_support import SecureStack  # only the secure tests pay for its imports
    stack = SecureStack()
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture
def topic_prefix() -> str:
    """A topic prefix unique to this test."""
    return f"t{uuid.uuid4().hex[:12]}."


@pytest.fixture
def group_id() -> str:
    """A consumer group id unique to this test."""
    return f"g{uuid.uuid4().hex[:12]}"


@pytest.fixture
def settings(kafka_bootstrap: str, registry_url: str, topic_prefix: str) -> Settings:
    """Settings for this test: its own topic prefix, the fixture broker and registry."""
    return Settings.from_env(
        {},
        bootstrap_servers=kafka_bootstrap,
        registry_url=registry_url,
        topic_prefix=topic_prefix,
        partitions=TEST_PARTITIONS,
        replication_factor=1,
        group_id_prefix=f"{topic_prefix}g-",
    )


@pytest.fixture
async def topics(kafka_bootstrap: str, topic_prefix: str) -> Settings:
    """Settings for this test's driver (no registry), its topics created."""
    from driver_topics import driver_topics
    return await driver_topics(kafka_bootstrap, topic_prefix)


@pytest.fixture
def dashboard_worker(kafka_bootstrap: str, topic_prefix: str,
                     tmp_path: pathlib.Path) -> Iterator[object]:
    """A ``dsh-pipeline processors`` subprocess on this test's dashboard settings
    (``dashboard_support.dashboard_settings``), stopped after the test."""
    from dashboard_support import dashboard_settings
    from processors_support import Worker, free_port
    started = Worker(dashboard_settings(kafka_bootstrap, topic_prefix), free_port(),
                     tmp_path / "processors")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module", params=["compiled", "python"])
def decoder_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a module's tests with the compiled session-event decoder, then with the generated
    Python (the two paths of pipeline.codec.binary_native); the compiled run is skipped,
    saying so, where the install could not build it."""
    from pipeline.codec.binary import use_compiled_decoders
    from pipeline.codec.schemas import current_event_schema

    if request.param == "compiled" and current_event_schema().binary.compiled_decoder is None:
        pytest.skip("the compiled decoder is not built (no Cython or C compiler at install)")
    use_compiled_decoders(request.param == "compiled")
    try:
        yield request.param
    finally:
        use_compiled_decoders(True)


@pytest.fixture(scope="session")
def mcp_servers() -> object:
    """The third-party MCP servers (tests/support/mcp_support.py), installed if missing."""
    from mcp_support import find_servers
    return find_servers()
