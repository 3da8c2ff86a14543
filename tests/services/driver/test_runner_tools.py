"""The driver's tool registry: schema checks, failures as results, timeouts, host tools."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pipeline.core.errors import ConfigError
from pipeline.services.driver.tools import ToolRegistry, ToolSpec, builtin_registry, schema_errors

SCHEMA = {"type": "object", "required": ["n"], "additionalProperties": False,
          "properties": {"n": {"type": "integer", "minimum": 1},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "mode": {"enum": ["a", "b"]}}}


@pytest.mark.parametrize(("value", "problem"), [
    ({"n": 2, "tags": ["x"], "mode": "a"}, None),
    ({}, "missing required property 'n'"),
    ({"n": True}, "$.n: expected integer, got boolean"),
    ({"n": 0}, "$.n: must be >= 1"),
    ({"n": 1, "tags": ["x", 3]}, "$.tags[1]: expected string, got integer"),
    ({"n": 1, "mode": "c"}, "$.mode: must be one of"),
    ({"n": 1, "extra": 1}, "unexpected property 'extra'"),
])
def test_schema_errors_name_the_path(value: Any, problem: str | None) -> None:
    errors = schema_errors(value, SCHEMA)
    if problem is None:
        assert errors == []
    else:
        assert any(problem in e for e in errors), errors


async def test_builtins_run_and_failures_become_results() -> None:
    registry = builtin_registry()
    assert registry.names == ["clock", "echo", "sleep"]
    ok = await registry.run("echo", '{"text": "hi"}')
    assert ok.content == ({"type": "text", "text": "hi"},) and not ok.is_error
    bad = await registry.run("echo", "{not json")
    assert bad.is_error and bad.error == {"name": "ToolArgumentsError",
                                          "code": "INVALID_ARGUMENTS"}
    assert (await registry.run("echo", "[1]")).error["code"] == "INVALID_ARGUMENTS"
    assert (await registry.run("nope", "{}")).error["code"] == "UNKNOWN_TOOL"
    clock = await registry.run("clock", "")
    assert isinstance(clock.meta["epochMs"], int)


async def test_timeouts_and_exceptions_are_error_results() -> None:
    never = asyncio.Event()

    async def hang(args: dict[str, Any]) -> str:
        await never.wait()
        return "unreachable"

    async def boom(args: dict[str, Any]) -> str:
        raise RuntimeError("disk on fire")

    async def wrong(args: dict[str, Any]) -> Any:
        return 42

    registry = ToolRegistry([
        ToolSpec("hang", "", {"type": "object"}, hang, timeout_s=0.01),
        ToolSpec("boom", "", {"type": "object"}, boom),
        ToolSpec("wrong", "", {"type": "object"}, wrong)])
    assert (await registry.run("wrong", "{}")).error["code"] == "TOOL_FAILED"
    timed_out = await registry.run("hang", "{}")
    assert timed_out.error == {"name": "ToolTimeoutError", "code": "TOOL_TIMEOUT"}
    failed = await registry.run("boom", "{}")
    assert failed.error == {"name": "ToolExecutionError", "code": "TOOL_FAILED"}
    assert "disk on fire" in failed.content[0]["text"]


async def test_host_tools_only_when_enabled() -> None:
    assert builtin_registry().get("bash") is None
    registry = builtin_registry(enable_host_tools=True)
    spec = registry.get("bash")
    assert spec is not None and not spec.parallel_safe
    ok = await registry.run("bash", '{"command": "echo SNAPSHOT_OK"}')
    assert ok.content == ({"type": "text", "text": "SNAPSHOT_OK\n"},) and ok.meta == {
        "exitCode": 0}
    failed = await registry.run("bash", '{"command": "exit 3"}')
    assert failed.is_error and failed.meta == {"exitCode": 3}
    big = await registry.run("bash", json.dumps({"command": "yes x | head -c 100000"}))
    assert "[output truncated: 100000 characters" in big.content[0]["text"]


def test_registry_refuses_bad_specs() -> None:
    async def noop(args: dict[str, Any]) -> str:
        return ""

    registry = builtin_registry()
    with pytest.raises(ConfigError, match="registered twice"):
        registry.register(ToolSpec("echo", "", {"type": "object"}, noop))
    with pytest.raises(ConfigError, match="type 'object'"):
        registry.register(ToolSpec("x", "", {"type": "string"}, noop))
    with pytest.raises(ConfigError, match="unknown tools"):
        registry.definitions(["echo", "bash"])
    assert registry.definitions(["echo"])[0]["name"] == "echo"
