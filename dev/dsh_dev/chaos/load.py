"""The campaign's load: N sessions receiving inbox commands at random, and dsh files to ship.

Every session starts with a configure (provider, model, the ``echo`` tool) and a follow-up;
then commands are drawn by seed: follow-ups, steers, injects, cancels and configures. Three
sessions in four belong to a tenant (:data:`TENANTS`, by the session's number; every command
of such a session names it, in the inbox record's ``tenant`` field), the others to the
default tenant. Each command is sent straight to the brokers (acks=all) and remembered with
its partition and offset (:class:`SentCommand`), so the invariants can ask where each one
went.

The shipped files are synthetic dsh sessions (:func:`dsh_dev.synth.synth_session`)
written into the shipper's directory in growing prefixes: a file is rewritten with more
events (written to a temporary name and renamed, sometimes in dsh's packed chunk rows), so
the shipper sees files grow while it follows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from dsh_dev.chaos.sender import Sender
from dsh_dev.synth import synth_header, synth_session
from pipeline.codec.inbox import InboxCodec
from pipeline.codec.sessionfile import write_session_file
from pipeline.core.errors import BrokerError
from pipeline.core.events import Event
from pipeline.core.inbox import (
    Cancel,
    Configure,
    FollowUp,
    InboxCommand,
    Inject,
    Steer,
    with_tenant,
)
from pipeline.settings import Settings

KINDS: Final = ("followup", "steer", "inject", "cancel", "configure")
WEIGHTS: Final = (40, 15, 15, 10, 20)
PROVIDER: Final = "openai"
MODELS: Final = ("chaos-model-a", "chaos-model-b")
# By the session's number modulo 4: None is the default tenant (no tenant stated).
TENANTS: Final = (None, "acme", "globex", "acme")
SHIP_FILE_EVENTS: Final = (200, 1200)  # events a shipped session grows to


@dataclass(frozen=True, slots=True)
class SentCommand:
    session_id: str
    message_id: str
    kind: str
    partition: int
    offset: int
    wall_ms: int


def session_tenants(sessions: list[str]) -> dict[str, str]:
    """The tenant of each session that has one (:data:`TENANTS`, by its number)."""
    return {session_id: tenant for n, session_id in enumerate(sessions)
            if (tenant := TENANTS[n % len(TENANTS)]) is not None}


@dataclass(slots=True)
class Load:
    """Sends the commands; ``sent`` is everything acknowledged, ``failed`` what was not."""

    settings: Settings
    sessions: list[str]
    seed: int
    tenants: dict[str, str] = field(default_factory=dict)  # session -> its tenant
    sent: list[SentCommand] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    _codec: InboxCodec = field(default_factory=InboxCodec)
    _count: int = 0

    async def run(self, sender: Sender, stop: asyncio.Event, rate_per_s: float) -> None:
        """Open every session, then send commands at ``rate_per_s`` until ``stop``."""
        rng = random.Random(self.seed)
        for session_id in self.sessions:
            await self._send(sender, self._configure(session_id, rng))
            await self._send(sender, self._message(FollowUp, session_id))
        while not stop.is_set():
            session_id = rng.choice(self.sessions)
            kind = rng.choices(KINDS, WEIGHTS)[0]
            await self._send(sender, self._command(kind, session_id, rng))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), rng.expovariate(rate_per_s))

    def _command(self, kind: str, session_id: str, rng: random.Random) -> InboxCommand:
        if kind == "followup":
            return self._message(FollowUp, session_id)
        if kind == "steer":
            return self._message(Steer, session_id)
        if kind == "inject":
            return self._message(Inject, session_id)
        if kind == "cancel":
            return Cancel(session_id=session_id, message_id=self._next_id(session_id),
                          keep_queue=rng.random() < 0.5)
        return self._configure(session_id, rng)

    def _configure(self, session_id: str, rng: random.Random) -> Configure:
        return Configure(session_id=session_id, message_id=self._next_id(session_id),
                         provider=PROVIDER, model=rng.choice(MODELS),
                         system=f"You are chaos agent {rng.randint(1, 9)}.",
                         tools=("echo",) if rng.random() < 0.7 else (),
                         max_tokens=rng.choice((256, 1024, 4096)))

    def _message(self, cls: type[FollowUp | Steer | Inject], session_id: str) -> InboxCommand:
        message_id = self._next_id(session_id)
        text = f"{cls.__name__} {message_id}: check the log, call echo, then answer."
        return cls(session_id=session_id, message_id=message_id,
                   content=({"type": "text", "text": text},))

    def _next_id(self, session_id: str) -> str:
        self._count += 1
        return f"{session_id}-m{self._count:06d}"

    async def _send(self, sender: Sender, command: InboxCommand) -> None:
        tenant = self.tenants.get(command.session_id)
        if tenant is not None:
            command = with_tenant(command, tenant)
        try:
            partition, offset = await sender.send(
                self.settings.topics.inbox, command.session_id.encode(),
                self._codec.encode(command))
        except BrokerError as exc:
            # Not acknowledged: it may or may not be on the topic; the check then skips it.
            self.failed.append(f"{command.message_id}: {exc}")
            return
        self.sent.append(SentCommand(command.session_id, command.message_id, command.kind,
                                     partition, offset, int(time.time() * 1000)))


@dataclass(slots=True)
class ShipLoad:
    """Grows synthetic session files in the shipper's directory, as dsh writes live sessions.

    A file grows by slices cut anywhere, also mid-turn: the shipper then publishes an open
    turn that its next pass continues, and a driver assigned the partition meanwhile must
    leave it alone (the session is the shipper's). Every file ends with a whole turn, so the
    final checks see no open turn.
    """

    directory: Path
    seed: int
    files: dict[str, list[Event]] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)  # session -> events on disk

    def plan(self, count: int) -> None:
        rng = random.Random(self.seed)
        for n in range(count):
            seed = self.seed * 1000 + n
            events = synth_session(seed, rng.randint(*SHIP_FILE_EVENTS))
            session_id = f"ship-{self.seed}-{n:03d}"
            self.files[session_id] = events[: _turn_ends(events)[-1]]
            self.written[session_id] = 0

    def grow(self, rng: random.Random) -> bool:
        """Write one more slice of a random unfinished file; False when all are whole."""
        pending = [s for s, events in self.files.items() if self.written[s] < len(events)]
        if not pending:
            return False
        session_id = rng.choice(pending)
        events = self.files[session_id]
        upto = min(len(events), self.written[session_id] + rng.randint(20, 200))
        header = {**synth_header(self.seed), "id": session_id}
        write_session_file(self.directory / f"{session_id}.jsonl", events[:upto],
                           header=header, packed=rng.random() < 0.5)
        self.written[session_id] = upto
        return True

    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        rng = random.Random(self.seed + 1)
        while not stop.is_set() and self.grow(rng):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)

    def finish(self) -> None:
        """Write every file whole (before the final checks)."""
        rng = random.Random(self.seed + 2)
        while self.grow(rng):
            pass


def _turn_ends(events: list[Event]) -> list[int]:
    """The lengths of ``events`` prefixes that end with a ``turn/end`` (at least one)."""
    ends = [n + 1 for n, event in enumerate(events) if event.type == "turn/end"]
    return ends or [len(events)]
