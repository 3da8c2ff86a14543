"""Projection versions: which topic readers read, and the handover that keeps it live.

Version 0 is the processors' topic ``<prefix>derived-messages``; version N (N >= 1) is
``<prefix>derived-messages.vN``, rebuilt by ``replay`` from offset 0. The compacted control
topic ``<prefix>projection-versions`` says which version is active (the record formats and
the pure rules are in :mod:`pipeline.core.projection`; the processors' side is
``pipeline.adapters.kafka.projection_follow``).

**The problem.** A rebuilt version is a snapshot of the log up to the offsets the rebuild
read. If readers switched to it while the processors kept publishing their live changes to
the old version, the new one would be stale from the moment of the switch. Letting both the
rebuild and the processors write the new topic does not work either: they write the same
compacted slot keys from different points of the log, so an older value can land last.

**The handover (one writer per version at a time, every change exactly once, in order).**

1. ``replay`` rebuilds version N up to the end offsets at its start (the processors stay
   live on the old version meanwhile) and verifies it.
2. If live writers are registered (every processors worker registers itself as
   ``derived-messages/writer/<worker>`` while it runs), ``replay`` writes the request
   ``derived-messages/handover`` = {N, a new request id} and waits until, for every
   partition of the session topic, a worker has answered
   ``derived-messages/held/<worker>`` = {that request id, its partitions} (an answer to an
   earlier request, e.g. from a worker that has crashed since, never counts; a worker
   assigned partitions while a request is pending reads the pointer and holds before it
   folds any of their records).
   A worker that holds gives no record a publishing topic any more (it blocks before its
   next record), so from then on nothing publishes derived changes anywhere.
3. ``replay`` extends version N from where the rebuild stopped to the session topic's
   current end (its last stable offsets, read a second after every partition is held),
   waits for every record it wrote to be acknowledged, and only then writes the active
   pointer {N, covered: per partition, the offset after the last record it folded} and
   withdraws the request. Until this record exists no one else writes version N.
4. The workers see the pointer and continue. A record below ``covered`` of its partition is
   folded into the worker's tables but publishes nothing (the rebuild wrote its change); a
   record at or past it publishes to version N. The processors' fold and the rebuild's are
   the same core fold of the same records, so the worker's state at ``covered`` is the
   rebuild's, and its changes continue the rebuild's exactly.

Why this holds: per slot key (one partition of version N, same partitioner for both
producers), every rebuild record was acknowledged before the pointer existed and every
processors record is written after a worker read it: the rebuild's records come first, then
the processors' in log order. No record is published by both (the ``covered`` offsets split
the log) and none by neither: a record the processors folded before holding lies below the
end the extension read, so the rebuild covered it. That stays true when the processors' own
offsets are off (a crash that left their tables ahead of their committed offsets, a
rebalance during the hold), because ``covered`` comes from the log's end, not from what the
workers report. A worker started or assigned partitions later reads the pointer first and
applies the same rule. The old version keeps whatever the processors last published there
and is no longer read: it can be deleted once no reader uses it.

The argument assumes the workers fold committed records only: a worker reading uncommitted
ones may have folded records of a driver transaction still open when it held, past the
stable offset the extension reads to; the second of settling before the extension lets such
short transactions end, but only reading committed makes it exact (and keeps aborted records
out of the tables altogether).

**One replay at a time.** Two replays started together claim different versions (the
version's topic is created by exactly one of them, :func:`claim_version`). The handover key
holds one request, so only one of them may hand over. A replay refuses to start while
another's request is pending (checked before it rebuilds, and again before it requests),
stops when its own is replaced while it waits (a request written in the same instant as
another's), checks again right before it activates, and never withdraws a request that is
not its own; the one that stops switches nothing and says which handover is pending. What
remains is the moment between that last check and the activation record. A replay killed
mid-handover leaves its request behind and the workers hold until ``replay
--withdraw-handover`` clears it (the next replay refuses to start meanwhile); they hold
rather than guess whether the dead replay activated.

Without registered writers (no processors running) step 2 is skipped: the pointer's
``covered`` still tells processors started later which records are in the topic already.
A worker that crashed leaves its writer record behind; if no live worker answers for some
partitions within the timeout, the request is withdrawn (the workers resume on the old
version) and ``replay`` fails naming the partitions and the registered writers.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from pipeline.adapters.kafka.projection_pointer import (
    DERIVED_MESSAGES,
    pointer_topic,
    read_pointer_state,
    write_pointer_records,
)
from pipeline.adapters.kafka.topic_scan import ensure_topic
from pipeline.core.errors import BrokerError
from pipeline.core.events import JsonValue
from pipeline.core.projection import (
    ActivePointer,
    HandoverRequest,
    PointerState,
    handover_key,
    layout_key,
)
from pipeline.settings import Settings

PROJECTION: Final = DERIVED_MESSAGES
HANDOVER_TIMEOUT_S: Final = 60.0
_POLL_S: Final = 0.5


def version_topic(settings: Settings, version: int) -> str:
    base = settings.topics.derived_messages
    return base if version == 0 else f"{base}.v{version}"


@dataclass(frozen=True, slots=True)
class ActiveVersion:
    version: int
    topic: str


async def read_pointer(settings: Settings) -> PointerState:
    """The pointer topic folded (an empty state when the topic does not exist yet)."""
    return await read_pointer_state(settings, PROJECTION)


async def active_version(settings: Settings) -> ActiveVersion:
    """The version readers use: the last switch recorded, else version 0."""
    active = (await read_pointer(settings)).active
    if active is None:
        return ActiveVersion(0, version_topic(settings, 0))
    return ActiveVersion(active.version, active.topic)


async def write_pointer(settings: Settings, records: Mapping[str, JsonValue | None]) -> None:
    """Write pointer records in order and wait for them (a None value: a tombstone)."""
    await write_pointer_records(settings, records)


async def claim_version(settings: Settings, active: ActiveVersion) -> int:
    """The first version after ``active`` whose topic this call created. The broker creates
    a topic once, so two replays started together never rebuild into the same version; a
    topic that exists was left by an earlier rebuild that was not switched to, or belongs
    to a concurrent one. The version gets the ``session`` layout (its changes lie in their
    session's partition) before anything is written to it."""
    version = active.version + 1
    while not await ensure_topic(settings, version_topic(settings, version), compact=True):
        version += 1
    await write_pointer(settings, {layout_key(PROJECTION, version_topic(settings, version)):
                                   {"layout": "session"}})
    return version


async def request_handover(settings: Settings, version: int, *,
                           timeout_s: float = HANDOVER_TIMEOUT_S) -> HandoverRequest | None:
    """Step 2: ask the registered writers to hold for ``version`` and wait until every
    partition is held; the request written, or None when no writer is registered (nothing
    to wait for). Refused while another replay's request is pending, and stopped when that
    happens meanwhile (*One replay at a time*). On a timeout the request is withdrawn and
    a BrokerError says what was missing."""
    state = await read_pointer(settings)
    _refuse_a_concurrent_handover(state, settings, None)
    if not state.writers:
        return None
    request = HandoverRequest(version, version_topic(settings, version), uuid.uuid4().hex)
    await write_pointer(settings, {handover_key(PROJECTION): request.to_json()})
    wanted = set(range(settings.partitions))
    deadline = time.monotonic() + timeout_s
    while not wanted <= state.held_partitions(request.request):
        _refuse_a_concurrent_handover(state, settings, request)
        if time.monotonic() > deadline:
            await withdraw_handover(settings, request)
            missing = sorted(wanted - state.held_partitions(request.request))
            raise BrokerError(
                f"no live processors worker held partitions {missing} of "
                f"{settings.topics.session_events!r} within {timeout_s:.0f}s for the handover "
                f"to version {version} (registered writers: {sorted(state.writers)}); the "
                "request was withdrawn. Start the processors (a crashed worker's writer "
                "record goes away when it restarts) and run replay again")
        await asyncio.sleep(_POLL_S)
        state = await read_pointer(settings)
    return request


def _refuse_a_concurrent_handover(state: PointerState, settings: Settings,
                                  ours: HandoverRequest | None) -> None:
    pending = state.pending()
    if pending is None or (ours is not None and pending.request == ours.request):
        return
    lost = "" if ours is None else (f" Its request for version {ours.version} was replaced; "
                                    "the live processors hold for the other one.")
    raise BrokerError(
        f"another replay is handing over version {pending.version} ({pending.topic}, "
        f"request {pending.request}) on {pointer_topic(settings)!r}; nothing was "
        f"switched.{lost} Run one replay at a time: wait for it to finish, or if it is no "
        "longer running (the live processors hold until it is withdrawn), run "
        "`dsh-pipeline replay --withdraw-handover` and run replay again")


async def refuse_while_handing_over(settings: Settings) -> None:
    """A BrokerError naming the pending handover of another replay, if there is one: a
    replay checks before it rebuilds (minutes on a long log), not only once it is done."""
    _refuse_a_concurrent_handover(await read_pointer(settings), settings, None)


async def ensure_still_requested(settings: Settings, request: HandoverRequest) -> None:
    """Right before activating: ``request`` is still the pending one (a BrokerError when
    another replay's replaced it, see ``_refuse_a_concurrent_handover``)."""
    _refuse_a_concurrent_handover(await read_pointer(settings), settings, request)


async def withdraw_handover(settings: Settings, request: HandoverRequest | None
                            ) -> HandoverRequest | None:
    """Withdraw the pending request (the writers resume on the old version) when it is
    ``request``, or any pending one when ``request`` is None (``replay
    --withdraw-handover``: an operator clearing a replay that died mid-handover). Another
    replay's request is left alone. Returns what was withdrawn."""
    pending = (await read_pointer(settings)).pending()
    if pending is None or (request is not None and pending.request != request.request):
        return None
    await write_pointer(settings, {handover_key(PROJECTION): None})
    return pending


async def activate(settings: Settings, pointer: ActivePointer) -> None:
    """Step 3's end: the new version becomes active, then the request is withdrawn."""
    await write_pointer(settings, {PROJECTION: pointer.to_json(PROJECTION),
                                   handover_key(PROJECTION): None})
