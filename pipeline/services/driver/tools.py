"""The driver's tool registry: JSON-schema parameters, timeouts, a parallel-safe flag.

A tool never crashes a turn: bad JSON from the model, arguments that do not match the schema,
an unknown tool, a timeout or an exception inside the handler all come back as an error
:class:`ToolOutcome` (``isError`` + ``error:{name, code}``) that the model sees and can act on.

Built-ins are harmless (``echo``, ``clock``, ``sleep``). Anything that touches the host (the
``bash`` tool) is registered only when asked for explicitly (``enable_host_tools=True``).

Besides its own tools, a registry can draw on :class:`ToolSource` s whose tools come and go
(the MCP servers' tools, :mod:`.mcp_tools`): they are looked up at each use, so a server's
``list_changed`` reaches the next configure and the next call.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from pipeline.core.errors import ConfigError
from pipeline.core.events import JsonValue
from pipeline.core.turn_effects import ToolOutcome

ToolHandler = Callable[[dict[str, Any]], Awaitable[ToolOutcome | str]]
"""Receives the validated arguments; returns an outcome, or plain text for a success."""
PostExecute = Callable[[str, ToolOutcome], Awaitable[ToolOutcome]]
"""Transforms every call's outcome (tool name, outcome) before it is logged, as dsh's
``tools/post-execute``: the driver's is the spill policy (:mod:`.spill`)."""

INVALID_ARGUMENTS: Final = ("ToolArgumentsError", "INVALID_ARGUMENTS")
UNKNOWN_TOOL: Final = ("UnknownToolError", "UNKNOWN_TOOL")
TOOL_TIMEOUT: Final = ("ToolTimeoutError", "TOOL_TIMEOUT")
TOOL_FAILED: Final = ("ToolExecutionError", "TOOL_FAILED")
BASH_OUTPUT_LIMIT: Final = 64 * 1024
_JSON_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float), "null": (type(None),),
}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool: what the model is told (name, description, parameters) and how it runs."""

    name: str
    description: str
    parameters: Mapping[str, JsonValue]
    handler: ToolHandler
    timeout_s: float = 30.0
    parallel_safe: bool = False

    def definition(self) -> dict[str, JsonValue]:
        """The tool definition as the request header logs it."""
        return {"name": self.name, "description": self.description,
                "parameters": dict(self.parameters)}


def schema_errors(value: JsonValue, schema: Mapping[str, JsonValue], path: str = "$"
                  ) -> list[str]:
    """Check ``value`` against the JSON-schema subset tools use; the problems found.

    Supported: type (one or a list), properties, required, additionalProperties (false),
    items, enum, minimum/maximum, minLength/maxLength. Other keywords are ignored.
    """
    errors: list[str] = []
    expected = schema.get("type")
    if expected is not None:
        types = [expected] if isinstance(expected, str) else list(expected)
        if not any(_is_type(value, t) for t in types):
            return [f"{path}: expected {'/'.join(types)}, got {_json_type(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: must be one of {json.dumps(schema['enum'])[:80]}")
    errors += _bound_errors(value, schema, path)
    if isinstance(value, dict):
        errors += _object_errors(value, schema, path)
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{index}]")
    return errors


def _is_type(value: JsonValue, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(name, ()))


def _json_type(value: JsonValue) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, name):
            return name
    return type(value).__name__


def _bound_errors(value: JsonValue, schema: Mapping[str, JsonValue], path: str) -> list[str]:
    errors = []
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: must be >= {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: must be <= {schema['maximum']}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: must have at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: must have at most {schema['maxLength']} characters")
    return errors


def _object_errors(value: dict[str, JsonValue], schema: Mapping[str, JsonValue], path: str
                   ) -> list[str]:
    errors = [f"{path}: missing required property {name!r}"
              for name in schema.get("required", []) if name not in value]
    properties = schema.get("properties", {})
    for key, item in value.items():
        if key in properties:
            errors += schema_errors(item, properties[key], f"{path}.{key}")
        elif schema.get("additionalProperties") is False:
            errors.append(f"{path}: unexpected property {key!r}")
    return errors


class ToolSource(Protocol):
    """Tools that can change while the driver runs (an MCP server's, after ``list_changed``).
    Their names must not collide with the registry's own (MCP names start ``mcp__``)."""

    def specs(self) -> Mapping[str, ToolSpec]:
        """The tools now, by name (cheap: called at every look-up)."""
        ...


class ToolRegistry:
    """Tools by name. :meth:`run` turns every failure into an error outcome, then hands
    every outcome to the registry's ``post_execute`` (if any)."""

    def __init__(self, specs: Iterable[ToolSpec] = (), *,
                 post_execute: PostExecute | None = None,
                 sources: Iterable[ToolSource] = ()) -> None:
        self._specs: dict[str, ToolSpec] = {}
        self._post_execute = post_execute
        self._sources = list(sources)
        for spec in specs:
            self.register(spec)

    def with_post_execute(self, post_execute: PostExecute) -> ToolRegistry:
        """The same tools (and sources), every outcome passed through ``post_execute``."""
        return ToolRegistry(self._specs.values(), post_execute=post_execute,
                            sources=self._sources)

    def add_source(self, source: ToolSource) -> None:
        """Offer ``source``'s tools too (the registry's own win a name clash)."""
        self._sources.append(source)

    def _all(self) -> Mapping[str, ToolSpec]:
        if not self._sources:
            return self._specs
        merged: dict[str, ToolSpec] = {}
        for source in self._sources:
            merged.update(source.specs())
        merged.update(self._specs)
        return merged

    def register(self, spec: ToolSpec) -> None:
        if spec.name in self._specs:
            raise ConfigError(f"tool {spec.name!r} is registered twice")
        if spec.parameters.get("type") != "object":
            raise ConfigError(f"tool {spec.name!r}: parameters must be a JSON schema of "
                              "type 'object'")
        if spec.timeout_s <= 0:
            raise ConfigError(f"tool {spec.name!r}: timeout must be positive")
        self._specs[spec.name] = spec

    @property
    def names(self) -> list[str]:
        return sorted(self._all())

    def get(self, name: str) -> ToolSpec | None:
        spec = self._specs.get(name)
        return spec if spec is not None or not self._sources else self._all().get(name)

    def parallel_safe(self, name: str) -> bool:
        spec = self.get(name)
        return spec is not None and spec.parallel_safe

    def definitions(self, names: Sequence[str] | None = None) -> tuple[JsonValue, ...]:
        """Definitions of ``names`` (all tools if None); an unknown name is a ConfigError."""
        specs = self._all()
        chosen = sorted(specs) if names is None else list(names)
        unknown = [n for n in chosen if n not in specs]
        if unknown:
            raise ConfigError(f"unknown tools {unknown}; registered: {sorted(specs)}")
        return tuple(specs[n].definition() for n in chosen)

    async def run(self, name: str, arguments: str) -> ToolOutcome:
        """Run one call with its raw argument string; never raises for a tool's failure."""
        outcome = await self._run(name, arguments)
        if self._post_execute is None:
            return outcome
        return await self._post_execute(name, outcome)

    async def _run(self, name: str, arguments: str) -> ToolOutcome:
        spec = self.get(name)
        if spec is None:
            return _failure(f"Unknown tool {name!r}. Available tools: {', '.join(self.names)}.",
                            UNKNOWN_TOOL)
        parsed = _parse_arguments(arguments, spec.parameters)
        if isinstance(parsed, ToolOutcome):
            return parsed
        try:
            async with asyncio.timeout(spec.timeout_s):  # no task of its own, unlike wait_for
                result = await spec.handler(parsed)
        except TimeoutError:
            return _failure(f"Tool {name!r} timed out after {spec.timeout_s:g} s.", TOOL_TIMEOUT)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a tool's own bug must reach the model, not end the turn
            return _failure(f"Tool {name!r} failed: {type(exc).__name__}: {exc}", TOOL_FAILED)
        if isinstance(result, str):
            return ToolOutcome.text(result)
        if not isinstance(result, ToolOutcome):
            return _failure(f"Tool {name!r} returned a {type(result).__name__}, not text or a "
                            "ToolOutcome (a bug in the tool).", TOOL_FAILED)
        return result


def _failure(text: str, kind: tuple[str, str]) -> ToolOutcome:
    return ToolOutcome.failure(text, name=kind[0], code=kind[1])


def _parse_arguments(arguments: str, schema: Mapping[str, JsonValue]
                     ) -> dict[str, Any] | ToolOutcome:
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError as exc:
        return _failure(f"The arguments are not valid JSON ({exc}); send one JSON object "
                        "matching the tool's parameters.", INVALID_ARGUMENTS)
    if not isinstance(parsed, dict):
        return _failure("The arguments must be a JSON object.", INVALID_ARGUMENTS)
    errors = schema_errors(parsed, schema)
    if errors:
        return _failure("Invalid arguments: " + "; ".join(errors[:5]), INVALID_ARGUMENTS)
    return parsed


# -- built-ins ------------------------------------------------------------------------------


async def _echo(args: dict[str, Any]) -> str:
    return str(args["text"])


async def _clock(args: dict[str, Any]) -> ToolOutcome:
    now_ms = time.time_ns() // 1_000_000
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now_ms / 1000))
    return ToolOutcome(({"type": "text", "text": iso},), meta={"epochMs": now_ms})


async def _sleep(args: dict[str, Any]) -> str:
    await asyncio.sleep(float(args["ms"]) / 1000)
    return f"slept {args['ms']} ms"


async def _bash(args: dict[str, Any]) -> ToolOutcome:
    process = await asyncio.create_subprocess_exec(
        "bash", "-c", str(args["command"]),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        output, _ = await process.communicate()
    except asyncio.CancelledError:  # timeout or cancel: do not leave the process running
        process.kill()
        await process.wait()
        raise
    text = output.decode("utf-8", errors="replace")
    if len(text) > BASH_OUTPUT_LIMIT:  # the model gets the head and a note, not megabytes
        text = (text[:BASH_OUTPUT_LIMIT]
                + f"\n[output truncated: {len(text)} characters, first {BASH_OUTPUT_LIMIT} shown]")
    code = process.returncode
    if code != 0:
        return ToolOutcome(({"type": "text", "text": text},), True,
                           {"name": "CommandFailedError", "code": "EXIT_STATUS"},
                           meta={"exitCode": code})
    return ToolOutcome(({"type": "text", "text": text},), meta={"exitCode": code})


ECHO: Final = ToolSpec(
    "echo", "Return the given text unchanged.",
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
     "additionalProperties": False},
    _echo, timeout_s=5.0, parallel_safe=True)
CLOCK: Final = ToolSpec(
    "clock", "Return the current UTC time.",
    {"type": "object", "properties": {}, "additionalProperties": False},
    _clock, timeout_s=5.0, parallel_safe=True)
SLEEP: Final = ToolSpec(
    "sleep", "Wait for the given number of milliseconds (for demos).",
    {"type": "object", "properties": {"ms": {"type": "integer", "minimum": 0,
                                             "maximum": 600_000}},
     "required": ["ms"], "additionalProperties": False},
    _sleep, timeout_s=600.0, parallel_safe=True)
BASH: Final = ToolSpec(
    "bash", "Run a shell command on the driver's host and return its output.",
    {"type": "object", "properties": {"command": {"type": "string", "minLength": 1},
                                      "description": {"type": "string"}},
     "required": ["command"], "additionalProperties": False},
    _bash, timeout_s=120.0, parallel_safe=False)


def builtin_registry(*, enable_host_tools: bool = False) -> ToolRegistry:
    """``echo``, ``clock``, ``sleep``; plus ``bash`` only with ``enable_host_tools``."""
    specs = [ECHO, CLOCK, SLEEP]
    if enable_host_tools:
        specs.append(BASH)
    return ToolRegistry(specs)
