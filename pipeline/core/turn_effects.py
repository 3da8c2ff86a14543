"""What the turn state machine asks for (effects) and what it is told back (results).

The machine (:mod:`pipeline.core.turn_machine`) never performs I/O. It returns one effect at a
time; the runner performs it and reports the outcome through the machine's methods. Every
event the machine appends is already in the :class:`SessionLog` (validated, seq and time
stamped) when the runner sees it; the runner only has to publish it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from pipeline.core.errors import ConfigError
from pipeline.core.events import JsonValue
from pipeline.core.inbox import Configure

TOOL_CANCELED: Final = {"name": "ToolCanceledError", "code": "TOOL_CANCELED"}
TOOL_NOT_STARTED: Final = {"name": "ToolNotStartedError", "code": "TOOL_NOT_STARTED"}


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """What a request header says: provider, model and the optional knobs.

    ``tools`` holds tool *definitions* (``{name, description, parameters}``) so the logged
    header alone says what the model was offered.
    """

    provider: str
    model: str
    system: str | None = None
    tools: tuple[JsonValue, ...] | None = None
    reasoning_effort: str | None = None
    max_tokens: int | None = None

    @classmethod
    def configured(cls, base: SessionConfig | None, command: Configure,
                   tools: tuple[JsonValue, ...] | None) -> SessionConfig:
        """``base`` with what ``command`` sets (``tools``: its resolved definitions)."""
        provider = command.provider or (base.provider if base else None)
        model = command.model or (base.model if base else None)
        if provider is None or model is None:
            raise ConfigError(f"configure {command.message_id!r}: the first configure of a "
                              "session must name a provider and a model")

        def pick(new: Any, old: Any) -> Any:
            return new if new is not None else old

        return cls(provider, model,
                   pick(command.system, base.system if base else None),
                   pick(tools if command.tools is not None else None,
                        base.tools if base else None),
                   pick(command.reasoning_effort, base.reasoning_effort if base else None),
                   pick(command.max_tokens, base.max_tokens if base else None))

    def header(self) -> dict[str, JsonValue]:
        """The ``request/header`` ``data.header`` for this configuration."""
        config: dict[str, JsonValue] = {"provider": self.provider, "model": self.model}
        if self.reasoning_effort is not None:
            config["reasoningEffort"] = self.reasoning_effort
        if self.max_tokens is not None:
            config["maxTokens"] = self.max_tokens
        header: dict[str, JsonValue] = {"config": config}
        if self.system is not None:
            header["system"] = self.system
        if self.tools is not None:
            header["tools"] = list(self.tools)
        return header


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool-call block of an assistant message, in model order."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """What a tool gave back: content blocks, and on failure ``error={name, code}``."""

    content: tuple[JsonValue, ...]
    is_error: bool = False
    error: Mapping[str, str] | None = None
    meta: JsonValue = None

    @classmethod
    def text(cls, text: str) -> ToolOutcome:
        return cls(({"type": "text", "text": text},))

    @classmethod
    def failure(cls, text: str, *, name: str, code: str) -> ToolOutcome:
        return cls(({"type": "text", "text": text},), True, {"name": name, "code": code})


@dataclass(frozen=True, slots=True)
class HookDecision:
    """A pre-step hook chain's answer: the (possibly rewritten) messages, or a rejection."""

    messages: tuple[dict[str, JsonValue], ...]
    rejected: bool = False
    reason: str | None = None


# -- effects -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunPreStepHooks:
    """Run the pre-step hook chain over the messages claimed for this step."""

    turn: int
    step: int
    messages: tuple[dict[str, JsonValue], ...]


@dataclass(frozen=True, slots=True)
class CallModel:
    """Stream one model request; report chunks, then the end or the failure.

    ``request`` is a :class:`pipeline.core.model.ModelRequest` (typed loosely here so the
    effect types do not depend on the model module's import order).
    """

    request: Any
    attempt: int


@dataclass(frozen=True, slots=True)
class ChooseRoute:
    """Say which route (provider/model) the step's model call takes: the configured
    ``provider``/``model`` or one of its fallbacks (:mod:`pipeline.core.provider_routes`);
    report it with ``route_chosen``. Asked at each step's start by a machine made with
    ``routing=True``."""

    provider: str
    model: str


@dataclass(frozen=True, slots=True)
class RunTools:
    """Run these calls (model order); report each start and each outcome."""

    calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait before the next attempt (retry backoff), then call ``sleep_done``."""

    ms: int


@dataclass(frozen=True, slots=True)
class StepBoundary:
    """A flush point: what was appended so far should become durable and visible."""


@dataclass(frozen=True, slots=True)
class AwaitApproval:
    """A tool call waits for a person: nothing to do until a decision (an approve or deny
    command, a cancel) or ``deadline`` (epoch ms; None: no timeout, then ``expire_approval``).
    The wait is in the log: the runner may return and the session leave memory."""

    call_id: str
    deadline: int | None


@dataclass(frozen=True, slots=True)
class Idle:
    """No woken work: the turn (if any) is closed; wait for the next command."""


Effect: TypeAlias = (RunPreStepHooks | CallModel | RunTools | Sleep | StepBoundary | Idle
                     | AwaitApproval | ChooseRoute)
