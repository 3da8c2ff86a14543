"""The processors' side of a projection handover: which topic the derived changes go to.

``replay`` rebuilds a new version of the derived messages, then hands it over from the live
processors (the protocol and why it is correct: ``pipeline.services.replay.versions``; the
records and pure rules: :mod:`pipeline.core.projection`). A processors worker takes part
through one :class:`ProjectionFollow`:

- while it runs it is registered as a writer (``derived-messages/writer/<worker>``), so a
  rebuild knows it must ask it to hold;
- it follows the pointer topic (re-read every ``poll_s``, every ``holding_poll_s`` while a
  handover is pending, and on :meth:`refresh`);
- before folding each session-topic record the worker awaits :meth:`gate`, which returns the
  topic to publish that record's derived changes to, or None (fold, publish nothing: the
  rebuild wrote it), and blocks while a handover is pending; the follower answers the
  request (``derived-messages/held/<worker>``, with the partitions :attr:`owned` returns)
  as soon as it sees it, also when no record arrives. A record that passed the gate before
  the request published to the old version: harmless, the rebuild covers it.

Wiring (done in ``app.py``/``folding.py``; this module imports nothing of theirs):

    follow = ProjectionFollow(settings, worker_id,
                              owned=lambda: processors.active_partitions(session_events))
    # start it when the worker starts (gate() waits for that), stop it on shutdown (it
    # withdraws the writer); on every partition assignment: await follow.refresh()
    # in SessionFolder, before folding a batch (or a record):
    #     await follow.gate(first.partition, first.offset)
    #   and for each record: topic = follow.topic_for(record.partition, record.offset);
    #   its derived changes go to ``topic`` (none when it is None); usage and fleet as before

The pointer topic's I/O is :mod:`pipeline.adapters.kafka.projection_pointer`, shared with
replay (services never import each other).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from typing import Final

from pipeline.adapters.kafka.projection_pointer import (
    DERIVED_MESSAGES,
    pointer_topic,
    read_pointer_state,
    write_pointer_records,
)
from pipeline.core.errors import BrokerError
from pipeline.core.events import JsonValue
from pipeline.core.projection import (
    ActivePointer,
    HandoverRequest,
    HeldBy,
    PointerState,
    held_key,
    publish_topic,
    writer_key,
)
from pipeline.settings import Settings

log = logging.getLogger(__name__)

PROJECTION: Final = DERIVED_MESSAGES
# Each read of the pointer topic starts a consumer (about 60 ms of CPU): every 5 s is about
# 1% of a core; while holding, the activation is awaited more often, so the hold is short.
POLL_S: Final = 5.0
HOLDING_POLL_S: Final = 0.5
# A hold normally lasts as long as replay's extension (seconds); one this long is reported,
# and again every as long, with what to do when the replay that asked is gone.
LONG_HOLD_S: Final = 60.0


async def write_pointer_record(settings: Settings, key: str, value: JsonValue | None) -> None:
    await write_pointer_records(settings, {key: value})


class ProjectionFollow:
    """One processors worker's view of the derived-messages versions (see the module doc)."""

    def __init__(self, settings: Settings, worker: str, owned: Callable[[], Collection[int]],
                 *, poll_s: float = POLL_S, holding_poll_s: float = HOLDING_POLL_S) -> None:
        if not worker or "/" in worker:
            raise ValueError(f"worker id must be non-empty and without '/', got {worker!r}")
        self.settings = settings
        self.worker = worker
        self.owned = owned
        self.poll_s = poll_s
        self.holding_poll_s = holding_poll_s
        self.state = PointerState(PROJECTION)
        self._answered: tuple[str, frozenset[int]] | None = None  # request, partitions
        self._holding_since: float | None = None   # monotonic, while a request is pending
        self._reported_hold_s = 0.0
        self._changed = asyncio.Event()
        self._started = asyncio.Event()  # gate() waits for it: no record before the pointer
        self._task: asyncio.Task[None] | None = None
        self._failed: BaseException | None = None

    @property
    def active(self) -> ActivePointer:
        """The version this worker publishes to (version 0 until a switch is recorded)."""
        return self.state.active or ActivePointer(0, self.settings.topics.derived_messages)

    def status(self) -> dict[str, JsonValue]:
        """The version published to and the handover held for, if any (``/health``)."""
        pending = self.state.pending()
        holding: JsonValue = None
        if pending is not None and self._holding_since is not None:
            holding = {"version": pending.version, "topic": pending.topic,
                       "request": pending.request,
                       "seconds": round(time.monotonic() - self._holding_since, 1)}
        return {"version": self.active.version, "topic": self.active.topic,
                "holding": holding}

    async def start(self) -> None:
        """Register as a writer, read the pointer, follow it in the background. A failure
        is raised here and by every later :meth:`gate` (folding must not guess a version)."""
        try:
            await write_pointer_record(self.settings, writer_key(PROJECTION, self.worker),
                                       {"worker": self.worker})
            await self.refresh()
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            self._started.set()
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def stop(self) -> None:
        """Stop following and withdraw the writer (and any answer) records."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # both tombstones through one producer: a stop waits for one connection, not two
        await write_pointer_records(self.settings, {
            held_key(PROJECTION, self.worker): None, writer_key(PROJECTION, self.worker): None})

    async def refresh(self) -> None:
        """Read the pointer now (call it on every partition assignment, before folding)."""
        self.state = await read_pointer_state(self.settings)
        await self._answer()
        self._changed.set()
        self._changed = asyncio.Event()

    async def gate(self, partition: int, offset: int) -> str | None:
        """The topic for the derived changes of the record at ``partition``/``offset``
        (None: publish nothing); waits for :meth:`start`, and while a handover is pending."""
        if not self._started.is_set():
            await self._started.wait()
        if self._failed is not None:
            raise BrokerError(f"projection pointer {pointer_topic(self.settings)!r} could not "
                              f"be read at start: {self._failed}") from self._failed
        while self.state.pending() is not None:
            await self._changed.wait()
        return publish_topic(self.active, partition, offset)

    def topic_for(self, partition: int, offset: int) -> str | None:
        """:meth:`gate` without the wait, for the records after the first of a batch: a
        request seen mid-batch lets the rest of the batch publish to the old version
        (covered by the rebuild), and a switch seen mid-batch routes them by ``covered``."""
        return publish_topic(self.active, partition, offset)

    async def _answer(self) -> None:
        """Answer a pending request with the partitions owned now (again when they change);
        withdraw the answer once nothing is pending."""
        pending = self.state.pending()
        self._watch_hold(pending)
        if pending is None:
            if self._answered is not None:
                self._answered = None
                await write_pointer_record(self.settings, held_key(PROJECTION, self.worker),
                                           None)
            return
        answer = (pending.request, frozenset(self.owned()))
        if answer != self._answered:
            await write_pointer_record(self.settings, held_key(PROJECTION, self.worker),
                                       HeldBy(*answer).to_json())
            self._answered = answer
            log.info("holding partitions %s for the handover to version %d",
                     sorted(answer[1]), pending.version)

    def _watch_hold(self, pending: HandoverRequest | None) -> None:
        """Time the hold; report one that lasts (its replay may have died holding us)."""
        if pending is None:
            self._holding_since, self._reported_hold_s = None, 0.0
            return
        now = time.monotonic()
        if self._holding_since is None:
            self._holding_since = now
        held_s = now - self._holding_since
        if held_s >= self._reported_hold_s + LONG_HOLD_S:
            self._reported_hold_s = held_s
            log.warning("holding for the handover to version %d (request %s) for %.0f s: "
                        "nothing is folded meanwhile. If the replay that asked is no longer "
                        "running, run `dsh-pipeline replay --withdraw-handover`",
                        pending.version, pending.request, held_s)

    async def _follow(self) -> None:
        while True:
            pending = self.state.pending() is not None
            await asyncio.sleep(self.holding_poll_s if pending else self.poll_s)
            try:
                await self.refresh()
            except Exception as exc:  # the pointer is retried next poll; folding waits if held
                log.warning("reading %s failed: %s", pointer_topic(self.settings), exc)
