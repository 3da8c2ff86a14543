"""Every private name of faust-streaming and aiokafka the processors' transport relies on is
listed in :mod:`pipeline.adapters.faust.private_api` and present in the installed libraries:
an upgrade that removes or changes one fails here, naming it."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from aiokafka.consumer.subscription_state import SubscriptionState

from pipeline.adapters.faust import private_api

ADAPTER = Path(private_api.__file__).parent


def test_the_installed_libraries_have_every_listed_private_name() -> None:
    assert private_api.private_api_problems() == []


def test_the_supported_faust_build_is_in_use() -> None:
    assert private_api.faust_build_problem() is None
    private_api.require_supported_faust()


def test_a_changed_signature_or_a_missing_attribute_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import aiokafka.consumer.fetcher as fetcher
    import faust.transport.consumer as faust_consumer

    def _new_offset(self: object, tp: object, extra: object) -> None: ...

    monkeypatch.setattr(faust_consumer.Consumer, "_new_offset", _new_offset)
    monkeypatch.delattr(fetcher.Fetcher, "_create_fetch_waiter")
    attributes = (*private_api.attributes(), (fetcher.Fetcher, "_gone_in_next_release"))
    monkeypatch.setattr(private_api, "attributes", lambda: attributes)
    problems = private_api.private_api_problems()
    assert any("Consumer._new_offset: parameters ('tp', 'extra')" in p for p in problems)
    assert any("Fetcher._create_fetch_waiter: missing" in p for p in problems)
    assert any("Fetcher._gone_in_next_release" in p for p in problems)
    with pytest.raises(RuntimeError, match="_create_fetch_waiter"):
        private_api.require_supported_faust()


def test_the_other_faust_build_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import faust.streams
    monkeypatch.setattr(faust.streams, "_CStreamIterator", None)
    with pytest.raises(RuntimeError, match="NO_CYTHON"):
        private_api.require_supported_faust()


def _is_super(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def _private_attributes_used(path: Path) -> tuple[set[str], set[str]]:
    """Names ``x._name`` used on anything but ``self``, and ``super()._name`` calls."""
    found, inherited = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        if _is_super(node.value):
            inherited.add(node.attr)
        elif not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.add(node.attr)
    return found, inherited


def test_only_the_private_api_module_reaches_into_other_objects() -> None:
    listed = {name for _, name in private_api.attributes()}
    overridden = {name for _, name, _ in private_api.overridden()}
    for module in ADAPTER.glob("*.py"):
        found, inherited = _private_attributes_used(module)
        assert inherited <= overridden, module.name
        if module.name != "private_api.py":
            assert found - set(NOT_FAUST_OR_AIOKAFKA) == set(), module.name
        else:
            assert found <= listed | overridden, found - listed - overridden


# Private names of other libraries' objects used outside the private API module, and why
# each is not one of faust's or aiokafka's: any other one fails the scan below.
NOT_FAUST_OR_AIOKAFKA = {
    "_replace": "a namedtuple's documented method (urllib's SplitResult)",
    "_exit": "os._exit, documented",
    "_actions": "argparse's parser, for shell completion",
    "_SubParsersAction": "argparse's subparsers type, for shell completion",
    "_server": "aiohttp's TCPSite, for the port a metrics server bound",
}


def _foreign_private_names(path: Path) -> set[str]:
    """Names ``x._name`` used in ``path`` on anything but ``self``, ``cls`` and ``super()``
    that the module does not define itself (a function, class, attribute or name)."""
    tree = ast.parse(path.read_text())
    defined: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.alias):
            defined.add(node.asname or node.name.split(".")[-1])
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and not _is_super(node.value)
                and not (isinstance(node.value, ast.Name)
                         and node.value.id in ("self", "cls"))):
            used.add(node.attr)
    return used - defined


def test_no_module_of_the_package_reaches_into_faust_or_aiokafka_objects() -> None:
    """Anywhere in ``pipeline/``, a private name of faust or aiokafka goes through the
    private API module (the scan finds every foreign private name; the few of other
    libraries are named above)."""
    package = ADAPTER.parent.parent
    found = {str(module.relative_to(package)): names for module in package.rglob("*.py")
             if module != Path(private_api.__file__)
             and (names := _foreign_private_names(module) - set(NOT_FAUST_OR_AIOKAFKA))}
    assert found == {}


def test_the_scan_finds_a_private_name_of_a_library_object(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f(consumer):\n    return consumer._client\n"
                      "class C:\n    def g(self):\n        return self._own\n")
    assert _foreign_private_names(module) == {"_client"}


def test_the_adapter_s_own_private_names_shadow_nothing_in_faust() -> None:
    import inspect
    import re

    from pipeline.adapters.faust import changelog_queue, fetching, flushing, transport
    overridden = {name for _, name, _ in private_api.overridden()}
    for cls in (transport.BatchingConsumer, transport.BatchingTransport,
                fetching.ShortPollConsumerThread, flushing.FlushingProducer,
                flushing.DirectTopic, changelog_queue.ChangelogQueue,
                changelog_queue.ChangelogTableManager):
        base = cls.__mro__[1]
        own = {name for name in vars(cls) if name.startswith("_")
               and not name.startswith("__") and name != "_abc_impl"}
        own |= set(re.findall(r"self\.(_[a-z]\w*) =", inspect.getsource(cls)))
        shadowed = {name for name in own - overridden
                    if hasattr(base, name) or private_api._assigns(base, name)}
        assert shadowed == set(), (cls.__name__, shadowed)


def test_services_get_faust_s_kafka_transport_only_through_the_adapter() -> None:
    services = ADAPTER.parent.parent / "services"
    for module in services.rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [alias.name for alias in node.names]
                     if isinstance(node, ast.Import) else [])
            assert not any(name.startswith(("faust.transport", "aiokafka", "mode"))
                           for name in names), module


async def test_waiting_for_a_reassignment_is_bounded() -> None:
    """A group that never finishes rejoining (a worker stopping after a crash) cannot hold
    the consumer thread's fetch call past its timeout."""
    subscriptions = SubscriptionState()
    subscriptions.subscribe({"t"})
    fetcher = SimpleNamespace(_subscriptions=subscriptions)
    assert not await private_api.wait_for_reassignment(fetcher, 0.0)    # the first one
    subscriptions.assign_from_subscribed({TopicPartition("t", 0)})
    assert await private_api.wait_for_reassignment(fetcher, 0.0)        # none in progress
    subscriptions.begin_reassignment()
    assert not await private_api.wait_for_reassignment(fetcher, 0.05)
    waiting = asyncio.ensure_future(private_api.wait_for_reassignment(fetcher, 5.0))
    await asyncio.sleep(0.01)
    subscriptions.assign_from_subscribed({TopicPartition("t", 1)})
    assert await waiting
