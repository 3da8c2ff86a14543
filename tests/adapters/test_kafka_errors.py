"""aiokafka's exceptions are caught in one module, ``pipeline.adapters.kafka.errors``: every other
module of ``pipeline`` goes through its translator (``broker_errors``, ``quietly``) and sees only
BrokerError.

Read from the source with :mod:`ast`, as tests/system/test_import_cycles.py does: an
``except`` clause or a ``suppress(...)`` that names an aiokafka exception anywhere else is a
failure naming the module and the line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    InvalidSessionTimeoutError,
    KafkaConnectionError,
    KafkaTimeoutError,
    NotLeaderForPartitionError,
    ProducerFenced,
)

from pipeline.adapters.kafka.errors import broker_errors, is_fencing, is_transient, kafka_error
from pipeline.core.errors import BrokerError

ROOT = Path(__file__).resolve().parents[2]
TRANSLATOR = ROOT / "pipeline" / "adapters" / "kafka" / "errors.py"


def aiokafka_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names bound to aiokafka exceptions, names bound to aiokafka modules) in ``tree``.

    A name assigned from an expression that names an aiokafka exception (a tuple of them) is
    one too.
    """
    errors, modules = {"KafkaError"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aiokafka"):
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.module == "aiokafka.errors" or alias.name.endswith("Error"):
                    errors.add(bound)
                elif alias.name == "errors":
                    modules.add(bound)
        elif isinstance(node, ast.Import):
            modules.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                           if alias.name.startswith("aiokafka"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _names_aiokafka(node.value, errors, modules):
            errors.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return errors, modules


def _names_aiokafka(expr: ast.AST, errors: set[str], modules: set[str]) -> bool:
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and node.id in errors:
            return True
        if isinstance(node, ast.Attribute):
            base = node
            while isinstance(base, ast.Attribute):
                base = base.value  # type: ignore[assignment]
            if isinstance(base, ast.Name) and base.id in modules:
                return True
    return False


def catches(source: str) -> Iterator[int]:
    """Lines where ``source`` catches or suppresses an aiokafka exception."""
    tree = ast.parse(source)
    errors, modules = aiokafka_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            if _names_aiokafka(node.type, errors, modules):
                yield node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute)
              and (getattr(node.func, "id", None) or getattr(node.func, "attr", "")) == "suppress"
              and any(_names_aiokafka(arg, errors, modules) for arg in node.args)):
            yield node.lineno


def test_no_module_but_the_translator_catches_aiokafka_errors() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}"
             for path in sorted((ROOT / "pipeline").rglob("*.py")) if path != TRANSLATOR
             for line in catches(path.read_text(encoding="utf-8"))]
    assert found == [], ("catch aiokafka errors through pipeline.adapters.kafka.errors "
                         f"(broker_errors / quietly), not here: {found}")


@pytest.mark.parametrize("source", [
    "from aiokafka.errors import KafkaError\ntry:\n    x()\nexcept KafkaError:\n    pass\n",
    "from aiokafka.errors import ProducerFenced as PF\ntry:\n    x()\n"
    "except (TimeoutError, PF):\n    pass\n",
    "import aiokafka.errors\ntry:\n    x()\nexcept aiokafka.errors.KafkaError:\n    pass\n",
    "from aiokafka.errors import ProducerFenced\nFENCED = (ProducerFenced,)\ntry:\n    x()\n"
    "except FENCED:\n    pass\n",
    "import contextlib\nfrom aiokafka import errors\n"
    "with contextlib.suppress(errors.KafkaTimeoutError):\n    x()\n",
])
def test_the_scan_finds_a_catch(source: str) -> None:
    assert list(catches(source)) != []


def test_the_scan_lets_other_catches_and_error_codes_pass() -> None:
    source = ("from aiokafka.errors import for_code, TopicAlreadyExistsError\n"
              "try:\n    x()\nexcept (TimeoutError, ValueError):\n    pass\n"
              "ok = for_code(36) is TopicAlreadyExistsError\n")
    assert list(catches(source)) == []


def test_translation_names_what_was_done_and_the_aiokafka_class() -> None:
    with pytest.raises(BrokerError) as raised, broker_errors("send to 't'"):
        raise NotLeaderForPartitionError("moved")
    text = str(raised.value)
    assert text.startswith("send to 't': NotLeaderForPartitionError") and "moved" in text
    assert is_transient(raised.value) and not is_fencing(raised.value)


def test_a_timeout_names_the_limit_and_is_transient() -> None:
    with pytest.raises(BrokerError) as raised, broker_errors("read t[0]", timeout_s=30):
        raise TimeoutError()
    assert str(raised.value) == "read t[0]: timed out after 30s"
    assert is_transient(raised.value)
    assert str(kafka_error("x", TimeoutError())) == "x: timed out waiting for the broker"
    assert str(kafka_error("x", KafkaTimeoutError())).startswith("x: KafkaTimeoutError")


def test_fencing_and_refusals_are_told_apart() -> None:
    with pytest.raises(BrokerError) as fenced, broker_errors("commit"):
        raise ProducerFenced()
    assert is_fencing(fenced.value) and not is_transient(fenced.value)
    refused = kafka_error("join", GroupAuthorizationFailedError())
    assert "not authorized for the consumer group" in str(refused)
    unreachable = kafka_error("connect", KafkaConnectionError("no route"))
    assert "no broker accepted the connection" in str(unreachable)


def test_a_refused_session_timeout_says_which_broker_settings_bound_it() -> None:
    refused = kafka_error("cannot join group 'g'", InvalidSessionTimeoutError())
    assert "group.min.session.timeout.ms" in str(refused) and "--session-timeout" in str(refused)
    assert not is_transient(refused)
