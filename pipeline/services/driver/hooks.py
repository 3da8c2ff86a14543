"""Pre-step hooks: a waterfall chain over the messages claimed for a step.

Each hook gets the step's context, the claimed messages and ``next``; it delegates by calling
``await next(messages)`` (with the messages as they are, or rewritten) and may look at or change
the decision it gets back; it rejects by returning :func:`reject` without calling ``next``.
The end of the chain accepts whatever messages reach it. A rejected (or emptied) first claim of
a turn closes the turn with no steps (``turn/end blocked``); a rejection later in the turn
aborts it (``turn/end aborted`` with ``reason.kind == "hook"``).

Messages are shared with events already logged (the inbox splice that queued them): a hook
builds new message objects to rewrite, it never mutates the ones it is given.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pipeline.core.errors import ConfigError
from pipeline.core.events import JsonValue
from pipeline.core.turn_effects import HookDecision

Messages = tuple[dict[str, JsonValue], ...]
NextHook = Callable[[Messages], Awaitable[HookDecision]]


@dataclass(frozen=True, slots=True)
class PreStepContext:
    """Which step the claimed messages are about to enter."""

    session_id: str
    turn: int
    step: int


class PreStepHook(Protocol):
    """Any async callable ``(context, messages, next) -> HookDecision`` (names free)."""

    async def __call__(self, context: PreStepContext, messages: Messages, next_hook: NextHook,
                       /) -> HookDecision: ...


def reject(reason: str) -> HookDecision:
    """A hook's rejection of the claimed messages."""
    return HookDecision((), rejected=True, reason=reason)


async def run_pre_step_hooks(hooks: Sequence[PreStepHook], context: PreStepContext,
                             messages: Messages) -> HookDecision:
    """Run the chain; without hooks the claimed messages enter unchanged."""

    async def call(index: int, current: Messages) -> HookDecision:
        if index == len(hooks):
            return HookDecision(tuple(current))

        async def next_hook(rewritten: Messages) -> HookDecision:
            return await call(index + 1, tuple(rewritten))

        return await hooks[index](context, current, next_hook)

    return await call(0, messages)


def step_limit(max_steps: int) -> PreStepHook:
    """A hook that stops a turn before step ``max_steps + 1`` (a model looping on tools).

    The turn ends ``aborted`` with ``reason: {kind:"hook", reason:"step limit N reached"}``.
    """
    if max_steps < 1:
        raise ConfigError(f"step limit must be at least 1, got {max_steps}")

    async def limit(context: PreStepContext, messages: Messages,
                    next_hook: NextHook) -> HookDecision:
        if context.step > max_steps:
            return reject(f"step limit {max_steps} reached")
        return await next_hook(messages)

    return limit
