"""The per-session runner: performs the I/O the turn machine asks for.

:class:`SessionRunner` owns one session's :class:`~pipeline.core.turn_machine.TurnMachine` and
performs its effects: the pre-step hook chain, the provider stream, tool calls (parallel-safe
ones together, results logged in model order), retry backoff; it hands every appended event
to an :class:`EventSink` and flushes the sink at each step boundary. One turn at a time per
session; many sessions run concurrently on one event loop.

The in-memory sink and router (:mod:`pipeline.services.driver.memory`) run it without a broker;
the Kafka driver plugs its own sink (a transactional producer per inbox partition) into the
same :class:`SessionRunner`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from pipeline.core.approvals import ApprovalRules
from pipeline.core.errors import ConfigError, EventError, ProviderError
from pipeline.core.events import Event, JsonValue
from pipeline.core.inbox import Configure, InboxCommand
from pipeline.core.log import SessionLog
from pipeline.core.model import ModelRequest, RetryPolicy
from pipeline.core.rate_budget import (
    PROVIDER_GRANTED_TYPE,
    PROVIDER_WAIT_TYPE,
    estimated_tokens,
)
from pipeline.core.turn_effects import (
    AwaitApproval,
    CallModel,
    ChooseRoute,
    Effect,
    HookDecision,
    Idle,
    RunPreStepHooks,
    RunTools,
    SessionConfig,
    Sleep,
    StepBoundary,
    ToolCall,
    ToolOutcome,
)
from pipeline.core.turn_history import History
from pipeline.core.turn_machine import TurnMachine
from pipeline.services.driver.hooks import PreStepContext, PreStepHook, run_pre_step_hooks
from pipeline.services.driver.metrics import RunnerMetrics
from pipeline.services.driver.provider_gate import ProviderGate
from pipeline.services.driver.provider_router import ProviderRouter
from pipeline.services.driver.tools import ToolRegistry


def ms_clock() -> int:
    """Wall-clock epoch milliseconds (event times; never used for ordering)."""
    return time.time_ns() // 1_000_000


def uuid_id() -> str:
    """A random (version 4) UUID string, as ``str(uuid.uuid4())`` gives, at a quarter of its
    cost: two per step (the assistant message and each tool result need an id)."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # RFC 4122 variant
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


class ModelProvider(Protocol):
    """What the runner needs of a provider (``pipeline.adapters.llm`` providers fit it)."""

    def stream(self, request: ModelRequest) -> AsyncIterator[dict[str, JsonValue]]: ...


ProviderFactory = Callable[[str, str], ModelProvider]
"""``(provider, model) -> provider``; called once per pair and cached by the runner."""


class EventSink(Protocol):
    async def emit(self, session_id: str, events: Sequence[Event]) -> None:
        """Take appended events (in seq order); may buffer and batch."""

    async def flush(self, session_id: str) -> None:
        """A step boundary: make what was emitted durable and visible."""


class SessionRunner:
    """Runs one session's turns. ``submit`` never blocks; a cancel takes effect mid-turn."""

    def __init__(self, log: SessionLog, *, provider_factory: ProviderFactory,
                 tools: ToolRegistry, sink: EventSink, clock: Callable[[], int] = ms_clock,
                 hooks: Sequence[PreStepHook] = (), config: SessionConfig | None = None,
                 retry: RetryPolicy | None = None, new_id: Callable[[], str] = uuid_id,
                 jitter: Callable[[], float] = random.random,
                 request_check: Callable[[ModelRequest], ModelRequest] | None = None,
                 metrics: RunnerMetrics | None = None,
                 admit: Callable[[], Awaitable[None]] | None = None,
                 approvals: ApprovalRules | None = None, history: History | None = None,
                 gate: ProviderGate | None = None, router: ProviderRouter | None = None
                 ) -> None:
        """``config``: used until a configure command or a logged header says otherwise;
        its ``tools`` None means every tool of ``tools`` (the registry) is offered.
        ``metrics``: where provider calls, turns and steps are counted (None: nowhere).
        ``admit``: awaited before each step begins (the Kafka driver's
        ``PartitionSink.admit_step``: a bound on the steps per transaction); None: no wait.
        ``approvals``: which tool calls wait for a person, and for how long.
        ``gate``: the provider rate budgets a model call waits for (None: none).
        ``router``: the provider fallbacks (None: every call takes the configured model).
        ``history``: what the session's past left (a log resumed from a checkpoint holds
        only its open turn); None: read from ``log``.

        ``request_check`` (tests only) may rewrite the request just before it is checked
        against the log and sent: a rewrite is caught as an ``InvariantViolation``.
        """
        self.session_id = log.session_id
        self._gate = gate
        self._router = router
        if config is not None and config.tools is None:
            config = dataclasses.replace(config, tools=tools.definitions())
        self.machine = TurnMachine(log, new_id=new_id, config=config, retry=retry,
                                   approvals=approvals, history=history,
                                   routing=router is not None)
        self._provider_factory = provider_factory
        self._providers: dict[tuple[str, str], ModelProvider] = {}
        self._tools = tools
        self._sink = sink
        self._clock = clock
        self._hooks = tuple(hooks)
        self._jitter = jitter
        self._request_check = request_check
        self._metrics = metrics
        self._admit = admit
        self._lock = asyncio.Lock()
        # The loop of the running run_until_idle: asyncio's own look-up of the running loop
        # (ensure_future, current_task) makes a getpid() system call on every use.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._interruptible: asyncio.Future[Any] | None = None
        self._disposed = False

    @property
    def log(self) -> SessionLog:
        return self.machine.log

    @property
    def busy(self) -> bool:
        """A turn is open or the run loop is working."""
        return self._lock.locked() or self.machine.busy

    async def recover(self) -> None:
        """Crash repair: close the log's open turn, if any, and publish the closers."""
        async with self._lock:
            if self.machine.recover(self._clock()):
                await self._publish()
                await self._sink.flush(self.session_id)

    @property
    def approval_deadline(self) -> int | None:
        """When the call waiting for approval times out (epoch ms), or None."""
        return self.machine.approval_deadline

    def expire_approval(self) -> bool:
        """Deny a waiting call whose approval timed out; True if it did (then run the
        session: :meth:`run_until_idle`)."""
        return self.machine.expire_approval(self._clock())

    def submit(self, command: InboxCommand) -> None:
        """Hand over one inbox command (its splice is published by the run loop).

        A bad configure (unknown tool, no provider/model) raises ``ConfigError`` and changes
        nothing. After submitting, call :meth:`run_until_idle` (the :class:`Driver` does).
        """
        tools = None
        if isinstance(command, Configure) and command.tools is not None:
            tools = self._tools.definitions(command.tools)
        self.machine.submit(command, self._clock(), tools=tools)
        if self.machine.cancel_requested and self._interruptible is not None:
            self._interruptible.cancel()

    async def dispose(self) -> None:
        """Give the session up: abort an open turn (``aborted``/``disposed``) and wait for it
        to be closed and flushed. Queued inbox items stay queued in the log."""
        self._disposed = True
        self.machine.abort("disposed")
        if self._interruptible is not None:
            self._interruptible.cancel()
        await self.run_until_idle()

    async def run_until_idle(self) -> None:
        """Run turns while woken work is pending; returns when the session is idle."""
        async with self._lock:
            self._loop = asyncio.get_running_loop()
            begins_step = True  # the next effect may begin a step: wait for admission
            while True:
                if self._disposed and not self.machine.busy:
                    await self._publish()
                    await self._sink.flush(self.session_id)
                    return
                if begins_step and self._admit is not None:
                    # what is logged already (a command's inbox splice, logged when it was
                    # submitted) is not held back while this session waits to step
                    await self._publish()
                    await self._admit()
                effect = self.machine.next_effect(self._clock())
                begins_step = isinstance(effect, StepBoundary | Idle)
                if not isinstance(effect, RunPreStepHooks):
                    # a claim is published with the step and messages it opens (one emit),
                    # so no commit can hold the claim without the claimed messages
                    await self._publish()
                if isinstance(effect, Idle | AwaitApproval):
                    await self._sink.flush(self.session_id)
                    # a wait for approval is in the log: nothing runs until a decision
                    if isinstance(effect, AwaitApproval):
                        if self.machine.waiting_for is not None:  # not decided meanwhile
                            return
                    elif not self.machine.inbox.wakes:  # no await between check and return
                        return
                    continue
                await self._perform(effect)

    async def _perform(self, effect: Effect) -> None:
        if isinstance(effect, StepBoundary):
            await self._sink.flush(self.session_id)
        elif isinstance(effect, RunPreStepHooks):
            await self._run_hooks(effect)
        elif isinstance(effect, CallModel):
            await self._call_model(effect.request)
        elif isinstance(effect, ChooseRoute):
            assert self._router is not None  # only a machine made with routing asks
            self._router.route_step(self.machine, effect, self._clock())
        elif isinstance(effect, RunTools):
            await self._run_tools(effect.calls)
        elif isinstance(effect, Sleep) and await self._interruptibly(
                asyncio.sleep(effect.ms / 1000)):
            self.machine.sleep_done(self._clock())
        await self._publish()

    async def _publish(self) -> None:
        events = self.machine.take_events()
        if events:
            if self._metrics is not None:
                self._metrics.events(events)
            await self._sink.emit(self.session_id, events)

    async def _interruptibly(self, work: Any) -> bool:
        """Run ``work`` so a cancel command can stop it; False if it was stopped.

        The work runs as a task of its own (what :meth:`submit` cancels) and is awaited
        directly: a cancellation of this runner itself (shutdown) reaches the work too, and
        is told apart from a cancel command by :meth:`asyncio.Task.cancelling`.
        """
        loop = self._loop or asyncio.get_running_loop()
        task = loop.create_task(work)
        self._interruptible = task
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled() or _being_cancelled(loop):
                raise
            return False
        finally:
            self._interruptible = None
        if _being_cancelled(loop):  # the work swallowed our cancellation: honour it anyway
            raise asyncio.CancelledError
        return True

    async def _run_hooks(self, effect: RunPreStepHooks) -> None:
        if not self._hooks:  # nothing to run or to interrupt: the messages enter as claimed
            self.machine.hooks_done(HookDecision(effect.messages), self._clock())
            return
        context = PreStepContext(self.session_id, effect.turn, effect.step)
        decision_box: list[Any] = []

        async def run() -> None:
            decision_box.append(await run_pre_step_hooks(self._hooks, context, effect.messages))

        if await self._interruptibly(run()):
            self.machine.hooks_done(decision_box[0], self._clock())

    def _provider(self, request: ModelRequest) -> ModelProvider:
        key = (request.provider, request.model)
        provider = self._providers.get(key)
        if provider is None:
            provider = self._providers[key] = self._provider_factory(*key)
        return provider

    async def _call_model(self, request: ModelRequest) -> None:
        if self._request_check is not None:
            request = self._request_check(request)
        self.machine.check_request(request)  # the invariant: raises InvariantViolation
        await self._interruptibly(self._stream(request))

    async def _granted(self, request: ModelRequest) -> int:
        """Wait for the provider budget's grant (no connection is held meanwhile); the
        input tokens the call was estimated at (0: no budget)."""
        gate = self._gate
        if gate is None or gate.budget(request.provider, request.model) is None:
            return 0
        estimated = estimated_tokens(request.messages, request.system)
        which: dict[str, JsonValue] = {"provider": request.provider, "model": request.model}
        logged: list[bool] = []

        async def log_the_wait() -> None:  # the fleet shows the step as waiting
            logged.append(True)
            self.machine.note(PROVIDER_WAIT_TYPE, which, self._clock())
            await self._publish()

        waited = await gate.acquire(request.provider, request.model, tenant=self.machine.tenant,
                                    session_id=self.session_id, tokens=estimated,
                                    on_wait=log_the_wait)
        if logged:
            self.machine.note(PROVIDER_GRANTED_TYPE, {**which, "waitedMs": round(waited * 1000)},
                              self._clock())
        return estimated

    def _rate_limited(self, request: ModelRequest, exc: ProviderError) -> None:
        if self._gate is not None and exc.code == "RATE_LIMIT":
            retry_ms = exc.retry_after_ms if exc.retry_after_ms is not None else 1000
            self._gate.retry_after(request.provider, request.model, retry_ms / 1000)

    async def _stream(self, request: ModelRequest) -> None:
        machine = self.machine
        estimated = await self._granted(request)
        reported: int | None = None
        started = self._metrics.monotonic() if self._metrics is not None else 0.0
        try:
            chunks = self._provider(request).stream(request)
        except ConfigError as exc:  # e.g. a configure named a provider this driver lacks
            self._record_call(request, started, "CONFIG")
            machine.stream_failed(ProviderError(str(exc), code="CONFIG"), self._clock())
            return
        try:
            async for chunk in chunks:
                try:
                    machine.chunk(chunk, self._clock())
                except EventError as exc:  # the provider sent something the log refuses
                    raise ProviderError(f"the provider sent an invalid chunk: {exc}",
                                        code="INVALID_RESPONSE") from exc
                reported = _input_tokens(chunk, reported)
                await self._publish()
        except ProviderError as exc:
            self._record_call(request, started, exc.code)
            self._rate_limited(request, exc)
            fallback = (None if self._router is None
                        else self._router.fallback_for(machine, request, exc))
            machine.stream_failed(exc, self._clock(), jitter=self._jitter(), fallback=fallback)
        else:
            self._record_call(request, started, None)
            if self._router is not None:
                self._router.answered(request)
            machine.stream_ended(self._clock())
        finally:  # release the provider's connection even when cancelled mid-stream
            if estimated and reported is not None and self._gate is not None:
                self._gate.settle(request.provider, request.model, estimated, reported,
                                  tenant=self.machine.tenant)
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    def _record_call(self, request: ModelRequest, started: float, error_code: str | None
                     ) -> None:
        """A provider call ended (a cancelled one is not recorded: it has no outcome)."""
        if self._metrics is not None:
            self._metrics.provider_call(request.provider, request.model,
                                        self._metrics.monotonic() - started, error_code)

    async def _run_tools(self, calls: Sequence[ToolCall]) -> None:
        """Consecutive parallel-safe calls run together; any other call runs alone.

        A cancel stops further batches; calls already started are drained (their results
        are logged), the machine closes the unstarted ones. A call that needs approval runs
        alone, and when the machine holds it back (it waits, or was denied) nothing more
        starts: the machine's next effect says what follows.
        """
        machine = self.machine
        for batch in _batches(calls, self._tools.parallel_safe, machine.needs_approval):
            if machine.cancel_requested:
                return
            if len(batch) == 1:  # the common case: no tasks to run it alongside others
                if not machine.tool_started(batch[0].call_id, self._clock()):
                    return
                await self._publish()
                await self._tool_finished(*await self._run_tool(batch[0]))
                continue
            for call in batch:  # parallel-safe and ungated: each starts
                machine.tool_started(call.call_id, self._clock())
            await self._publish()
            for done in asyncio.as_completed([self._run_tool(call) for call in batch]):
                await self._tool_finished(*await done)

    async def _tool_finished(self, call: ToolCall, outcome: ToolOutcome) -> None:
        self.machine.tool_finished(call.call_id, outcome, self._clock())
        await self._publish()

    async def _run_tool(self, call: ToolCall) -> tuple[ToolCall, ToolOutcome]:
        return call, await self._tools.run(call.name, call.arguments)


def _input_tokens(chunk: dict[str, JsonValue], found: int | None) -> int | None:
    """The input tokens a ``usage`` chunk reports (cached ones included), else ``found``."""
    usage = chunk.get("usage") if chunk.get("type") == "usage" else None
    if not isinstance(usage, dict):
        return found
    total = sum(v for k in ("inputTokens", "cacheReadTokens", "cacheWriteTokens")
                if isinstance(v := usage.get(k), int))
    return total or found


def _being_cancelled(loop: asyncio.AbstractEventLoop) -> bool:
    task = asyncio.current_task(loop)
    return task is not None and task.cancelling() > 0


def _batches(calls: Sequence[ToolCall], parallel_safe: Callable[[str], bool],
             gated: Callable[[str], bool]) -> list[list[ToolCall]]:
    batches: list[list[ToolCall]] = []
    for call in calls:
        safe = parallel_safe(call.name) and not gated(call.name)
        if safe and batches and all(parallel_safe(c.name) and not gated(c.name)
                                    for c in batches[-1]):
            batches[-1].append(call)
        else:
            batches.append([call])
    return batches
