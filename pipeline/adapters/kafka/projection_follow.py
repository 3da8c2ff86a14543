"""The processors' side of a projection handover: which topic the derived changes go to.

``replay`` rebuilds a new version of the derived messages, then hands it over from the live
processors (the protocol and why it is correct: ``pipeline.services.replay.versions``; the
records and pure rules: :mod:`pipeline.core.projection`). A processors worker takes part
through one :class:`ProjectionFollow`:

- while it runs it is registered as a writer (``derived-messages/writer/<worker>``), so a
  rebuild knows it must ask it to hold;
- it follows the pointer topic through one consumer kept open
  (:class:`~pipeline.adapters.kafka.projection_pointer.PointerReader`): a record is read as
  soon as it is fetched, and the pointer is read again after ``poll_s`` without one
  (``holding_poll_s`` while a handover is pending) and on :meth:`refresh`. Every read goes up
  to end offsets listed after it began, and the state is acted on only after such a read:
  once it holds a record, it holds every record acknowledged before that one was written
  (replay writes the switch before it withdraws the request, maybe in another partition);
- before folding each session-topic record the worker awaits :meth:`gate`, which returns the
  topic to publish that record's derived changes to, or None (fold, publish nothing: the
  rebuild wrote it), and blocks while a handover is pending; the follower answers the
  request (``derived-messages/held/<worker>``, with the partitions :attr:`owned` returns)
  as soon as it sees it, also when no record arrives. A record that passed the gate before
  the request published to the old version: harmless, the rebuild covers it.
- a change goes to the partition the version's layout says (:meth:`partition_of`): with
  the ``session`` layout, its event's partition, so a reader of one session reads one
  partition. Version 0 gets that layout when a worker finds its topic never written and
  no layout named for it (:meth:`_claim_layout`): the first record ever published is
  therefore published after a layout was written, and a worker that finds the topic
  written reads the pointer after it looked, so it sees that layout. A topic written
  before layouts existed keeps ``key`` (the default partitioner's): ``replay`` rebuilds
  it into a version with the ``session`` layout.

Wiring (done in ``app.py``/``folding.py``; this module imports nothing of theirs):

    follow = ProjectionFollow(settings, worker_id,
                              owned=lambda: processors.active_partitions(session_events))
    # start it when the worker starts (gate() waits for that), stop it on shutdown (it
    # withdraws the writer); on every partition assignment: await follow.refresh()
    # in SessionFolder, before folding a batch (or a record):
    #     await follow.gate(first.partition, first.offset)
    #   and for each record: topic = follow.topic_for(record.partition, record.offset);
    #   its derived changes go to ``topic`` (none when it is None), in partition
    #   follow.partition_of(record.partition); usage and fleet as before

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

from pipeline.adapters.cancelling import cancel_until_done
from pipeline.adapters.kafka.projection_pointer import (
    DERIVED_MESSAGES,
    PointerReader,
    pointer_topic,
    read_pointer_state,
    write_pointer_records,
)
from pipeline.adapters.kafka.topic_scan import never_written
from pipeline.core.errors import BrokerError
from pipeline.core.events import JsonValue
from pipeline.core.projection import (
    ActivePointer,
    HandoverRequest,
    HeldBy,
    PointerState,
    fold_pointer_records,
    held_key,
    layout_key,
    publish_topic,
    writer_key,
)
from pipeline.settings import Settings

log = logging.getLogger(__name__)

PROJECTION: Final = DERIVED_MESSAGES
# Changes are read as they are fetched; these reads without one are a safety net (and time
# a hold for its report). A failed read is tried again, with a new consumer, after RETRY_S.
POLL_S: Final = 30.0
HOLDING_POLL_S: Final = 5.0
RETRY_S: Final = 5.0
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
        self._reader: PointerReader | None = None   # open between start and stop
        self._reading = asyncio.Lock()   # one read (or wait) on the reader at a time
        self._wake = asyncio.Event()     # a refresh is waiting: end the follower's wait
        self._reads_begun = 0
        self._read_ok = 0                # the number of the last read that succeeded

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
            async with self._reading:
                await self._read()
                await self._claim_layout()
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            self._started.set()
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def stop(self) -> None:
        """Stop following and withdraw the writer (and any answer) records."""
        task, self._task = self._task, None
        if task is not None:   # a cancellation can be lost in a client call: see there
            await cancel_until_done([task])
        await self._drop_reader()
        # both tombstones through one producer: a stop waits for one connection, not two
        await write_pointer_records(self.settings, {
            held_key(PROJECTION, self.worker): None, writer_key(PROJECTION, self.worker): None})

    async def refresh(self) -> None:
        """Read the pointer now: every record written before the call is in :attr:`state`
        when it returns (call it on every partition assignment, before folding)."""
        if self._task is None:   # not following: a read of its own
            self.state = await read_pointer_state(self.settings)
            await self._acted_on()
            return
        wanted = self._reads_begun + 1   # a read that begins after this call
        self._wake.set()
        async with self._reading:
            if self._read_ok < wanted:
                await self._read()

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

    def partition_of(self, partition: int) -> int | None:
        """The partition of a change, in the version :meth:`topic_for` just named, of an
        event in ``partition`` of the session topic (None: by its key)."""
        return self.state.partition_of(self.active.topic, partition)

    async def _claim_layout(self) -> None:
        """Name version 0's layout when nothing names it (module doc): ``session`` if its
        topic was never written, else ``key`` (written by code older than layouts). The
        pointer is read again after looking: a layout written before any record is seen."""
        topic = self.settings.topics.derived_messages
        if self.active.version != 0 or topic in self.state.layouts:
            return
        empty = await never_written(self.settings, topic)
        await self._read()
        if self.active.version != 0 or topic in self.state.layouts:
            return
        layout = "session" if empty else "key"
        await write_pointer_record(self.settings, layout_key(PROJECTION, topic),
                                   {"layout": layout})
        log.info("%s: %s; its changes lie %s", topic,
                 "never written" if empty else "written before layouts existed",
                 "in their session's partition" if empty else "where their key hashes")
        await self._read()

    async def _read(self) -> None:
        """Read the pointer up to its ends now (the lock held) and act on it. After a failure
        the reader is dropped: the next read starts over from the beginning."""
        onto: PointerState | None
        self._reads_begun += 1
        number = self._reads_begun
        self._wake.clear()   # every refresh waiting now is served by this read
        try:
            reader, onto = self._reader, self.state
            if reader is None:
                reader, onto = PointerReader(self.settings), None
                await reader.start()
                self._reader = reader
            self.state = fold_pointer_records(PROJECTION, await reader.read_to_now(),
                                              onto=onto)
        except BaseException:
            await self._drop_reader()
            raise
        self._read_ok = number
        await self._acted_on()

    async def _acted_on(self) -> None:
        """Answer what the state asks for, then let :meth:`gate` look at it again."""
        try:
            await self._answer()
        finally:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _drop_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            with contextlib.suppress(Exception):
                await reader.stop()

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
            async with self._reading:
                try:
                    await self._wait_for_change()
                    await self._read()
                except Exception as exc:  # tried again later; folding waits if held
                    await self._drop_reader()
                    log.warning("reading %s failed: %s", pointer_topic(self.settings), exc)

    async def _wait_for_change(self) -> None:
        """Until a pointer record is fetched or a refresh asks, at most ``poll_s``
        (``holding_poll_s`` while holding; ``RETRY_S`` after a failed read)."""
        timeout = self.holding_poll_s if self.state.pending() is not None else self.poll_s
        if self._reader is not None:
            await self._reader.wait(timeout, self._wake)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), min(timeout, RETRY_S))
