"""What a driver's owned partitions share and hold per session: the context (built once by
the service), the counters, and each session's slot (its log, runner and inbox offsets)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.adapters.kafka.session_reader import Decoder
from pipeline.core.inbox import InboxCommand
from pipeline.core.log import Mode, SessionLog
from pipeline.core.turn_history import History
from pipeline.services.driver.checkpointing import CheckpointStore
from pipeline.services.driver.kafka_sink import EventEncoder, PartitionSink
from pipeline.services.driver.metrics import RunnerMetrics
from pipeline.services.driver.provider_gate import ProviderGate
from pipeline.services.driver.provider_router import ProviderRouter
from pipeline.settings import Settings


class SessionRunnerLike(Protocol):
    """What the driver needs of a session runner (``runner.SessionRunner``)."""

    async def recover(self) -> None: ...
    def submit(self, command: InboxCommand) -> None: ...
    async def run_until_idle(self) -> None: ...
    async def dispose(self) -> None: ...
    @property
    def busy(self) -> bool: ...
    @property
    def approval_deadline(self) -> int | None: ...
    def expire_approval(self) -> bool: ...


RunnerFactory = Callable[[SessionLog, PartitionSink, History], SessionRunnerLike]
CommandDecoder = Callable[[bytes], InboxCommand]


@dataclass(slots=True)
class DriverMetrics:
    """Plain counters (``snapshot``), plus the runners' labelled series (``runner``)."""

    commands: int = 0
    duplicates: int = 0
    redelivered: int = 0
    dead_letters: int = 0
    sessions_rebuilt: int = 0  # loaded at a takeover (busy) or migrated
    sessions_loaded: int = 0   # evicted, then loaded again by a command or a deadline
    sessions_evicted: int = 0
    partitions_migrated: int = 0
    turns_repaired: int = 0
    session_failures: int = 0
    partitions_built: int = 0
    partitions_lost: int = 0
    fenced: int = 0
    broker_failures: int = 0
    pauses: int = 0
    events_committed: int = 0
    transactions: int = 0
    transactions_aborted: int = 0
    checkpoints_written: int = 0
    runner: RunnerMetrics = field(default_factory=RunnerMetrics)

    def snapshot(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__ if name != "runner"}


@dataclass(slots=True)
class SessionSlot:
    """A session owned through its partition: log, runner, and the offsets it works on."""

    session_id: str
    log: SessionLog
    runner: SessionRunnerLike | None
    message_ids: set[str] = field(default_factory=set)
    offsets: list[int] = field(default_factory=list)      # submitted, not yet idle
    awaiting: dict[str, int] = field(default_factory=dict)  # message id -> inbox offset
    task: asyncio.Task[None] | None = None
    failure: str | None = None
    writer: str | None = None  # another writer's mark: the driver never writes the session
    last_active: float = field(default_factory=time.monotonic)  # a command or a turn's end

    @property
    def driving(self) -> bool:
        return self.task is not None and not self.task.done()


@dataclass(frozen=True, slots=True)
class PartitionContext:
    """What every owned partition shares (built once by the service)."""

    settings: Settings
    group_id: str
    decode_event: Decoder
    encode_event: EventEncoder
    decode_command: CommandDecoder
    runner_factory: RunnerFactory
    metrics: DriverMetrics
    checkpoints: CheckpointStore
    gate: ProviderGate | None = None   # provider rate budgets, shared by partitions owned
    router: ProviderRouter | None = None  # provider fallbacks (None: none configured)
    linger_ms: float = 25.0
    rebuild_mode: Mode = "strict"
    pipelined_flush: bool = False  # True: a step boundary does not wait for its commit
    steps_per_transaction: int = 0  # PartitionSink's step budget (0: unbounded)
    idle_evict_s: float | None = None  # None: the settings' DSH_DRIVER_IDLE_EVICT
    load_retry_s: float = 1.0

    @property
    def evict_after_s(self) -> float:
        return (self.idle_evict_s if self.idle_evict_s is not None
                else self.settings.driver_idle_evict)
