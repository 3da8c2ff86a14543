"""The in-memory driver: :class:`SessionRunner` without a broker (unit tests, demos,
benchmarks).

:class:`MemorySink` keeps what the runners emit; :class:`Driver` routes commands to runners by
session id, one run task per session. The whole turn logic runs as under the Kafka driver
(which plugs its own sink into the same :class:`SessionRunner`)::

    provider = ScriptedProvider(echo_script)          # pipeline.adapters.llm.scripted
    driver = Driver(provider_factory=lambda _p, _m: provider, tools=builtin_registry(),
                    config=SessionConfig("scripted", "demo"))
    driver.submit(FollowUp("s1", "m1", ({"type": "text", "text": "hi"},)))
    await driver.drain()                              # every session idle again
    driver.runners["s1"].log.messages()               # the derived conversation
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pipeline.core.approvals import ApprovalRules
from pipeline.core.events import Event
from pipeline.core.inbox import InboxCommand
from pipeline.core.log import SessionLog
from pipeline.core.model import RetryPolicy
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.hooks import PreStepHook
from pipeline.services.driver.metrics import RunnerMetrics
from pipeline.services.driver.provider_gate import ProviderGate
from pipeline.services.driver.provider_router import ProviderRouter
from pipeline.services.driver.runner import (
    EventSink,
    ProviderFactory,
    SessionRunner,
    ms_clock,
    uuid_id,
)
from pipeline.services.driver.tools import ToolRegistry


class MemorySink:
    """Keeps every emitted event per session; counts flushes."""

    def __init__(self) -> None:
        self.events: dict[str, list[Event]] = {}
        self.flushes: dict[str, int] = {}

    async def emit(self, session_id: str, events: Sequence[Event]) -> None:
        self.events.setdefault(session_id, []).extend(events)

    async def flush(self, session_id: str) -> None:
        self.flushes[session_id] = self.flushes.get(session_id, 0) + 1


class Driver:
    """In-memory driver: routes commands to runners by session id, one run task per session."""

    def __init__(self, *, provider_factory: ProviderFactory, tools: ToolRegistry,
                 sink: EventSink | None = None, clock: Callable[[], int] = ms_clock,
                 hooks: Sequence[PreStepHook] = (), config: SessionConfig | None = None,
                 retry: RetryPolicy | None = None, new_id: Callable[[], str] = uuid_id,
                 jitter: Callable[[], float] = random.random,
                 metrics: RunnerMetrics | None = None,
                 approvals: ApprovalRules | None = None,
                 gate: ProviderGate | None = None,
                 router: ProviderRouter | None = None) -> None:
        self.sink: EventSink = sink if sink is not None else MemorySink()
        self._options: Mapping[str, Any] = {
            "provider_factory": provider_factory, "tools": tools, "sink": self.sink,
            "clock": clock, "hooks": hooks, "config": config, "retry": retry,
            "new_id": new_id, "jitter": jitter, "metrics": metrics, "approvals": approvals,
            "gate": gate, "router": router}
        self._clock = clock
        self.runners: dict[str, SessionRunner] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def runner(self, session_id: str, log: SessionLog | None = None) -> SessionRunner:
        """The session's runner, created on first use (over ``log`` or a new empty log)."""
        runner = self.runners.get(session_id)
        if runner is None:
            runner = SessionRunner(log or SessionLog(session_id), **self._options)
            self.runners[session_id] = runner
        return runner

    def submit(self, command: InboxCommand) -> None:
        self.runner(command.session_id).submit(command)
        self._wake(command.session_id)

    def submit_all(self, commands: Iterable[InboxCommand]) -> None:
        for command in commands:
            self.submit(command)

    def _wake(self, session_id: str) -> None:
        task = self._tasks.get(session_id)
        if task is None or task.done():
            self._tasks[session_id] = asyncio.ensure_future(self._run(session_id))

    async def _run(self, session_id: str) -> None:
        """Run the session until idle or waiting for approval; arm the wait's timeout."""
        runner = self.runners[session_id]
        await runner.run_until_idle()
        deadline = runner.approval_deadline
        if deadline is not None:
            asyncio.get_running_loop().call_later(
                max(0.0, deadline - self._clock()) / 1000, self._expire, session_id)

    def _expire(self, session_id: str) -> None:
        """A wait's deadline: deny the call (if still waiting) and run the session on."""
        task, runner = self._tasks.get(session_id), self.runners[session_id]
        if task is not None and not task.done():  # running: it arms the timer again
            return
        if runner.expire_approval():
            self._wake(session_id)
        elif runner.approval_deadline is not None:  # not due by the runner's clock yet
            asyncio.get_running_loop().call_later(0.01, self._expire, session_id)

    async def drain(self) -> None:
        """Wait until every session is idle; re-raises the first failure of a run loop."""
        while True:
            pending = [t for t in self._tasks.values() if not t.done()]
            if not pending:
                break
            await asyncio.wait(pending)
        for task in self._tasks.values():
            task.result()
