"""The vocabulary of dsh session format 0: which event types exist.

Core types are the 13 the session-log model defines (DESIGN.md section 1). Plugin types are
the ones real dsh logs carry besides them (dsh's own known-type list, release 0.1.0-rc.8);
the pipeline carries them losslessly without interpreting their data. Any other type is
unknown: a reader refuses it unless the event says ``ignorable: true``.
"""

from __future__ import annotations

from typing import Final

CORE_TYPES: Final = frozenset({
    "turn/start", "turn/end", "step/start", "step/end",
    "user/message", "assistant/chunk", "assistant/message",
    "tool/call", "tool/result",
    "request/header", "request/context", "todo/write", "session/end-seed",
})

PLUGIN_TYPES: Final = frozenset({
    "agent-preset/selected",
    "agent/inbox/spliced",
    "approval/asked", "approval/decided", "approval/policy",
    "command/done", "command/run",
    "compaction/start", "compaction/summary", "compaction/prune", "compaction/end",
    "feedback/record",
    "goal/change",
    "hook/invoked", "hook/result",
    "llm/retry", "llm/retry-started",
    "permission/preset",
    "plan/mode",
    "sandbox/mode",
    "schedule/change",
    "session/title", "session/title-llm-request",
    "subagent/descriptor",
    "team/member", "team/message/delivered", "team/message/queued", "team/task",
    "tool-workflow/agent-start", "tool-workflow/agent-end",
    "tool-workflow/run-start", "tool-workflow/run-end",
    "tool/code-dispatch", "tool/code-dispatch-start",
    "web/deepseek-search-llm-request",
})

KNOWN_TYPES: Final = CORE_TYPES | PLUGIN_TYPES

SURFACE_TYPES: Final = frozenset({"user/message", "assistant/message", "tool/result"})
"""The only types that may join the surface (carry ``surfaceOp``/``sourceEventSeqs``)."""

BOUNDARY_TYPES: Final = frozenset({"turn/start", "turn/end", "step/start", "step/end"})

CHUNK_DELTA_TYPES: Final = frozenset({"text-delta", "reasoning-delta", "tool-call-delta"})


def is_known(event_type: str) -> bool:
    """True for the core and plugin types this pipeline knows by name."""
    return event_type in KNOWN_TYPES


def is_core(event_type: str) -> bool:
    return event_type in CORE_TYPES
