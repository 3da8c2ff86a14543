"""Taking over an inbox partition: fence, read the checkpoints, load the busy sessions.

:func:`build_partition` never reads the session topic from offset 0, except once per
partition of a topic written by older code (the migration, ``checkpointing.py``):

1. start the partition's transactional producer: this fences the older owner (its open
   transaction is aborted), so what is read next is final. The reads below also wait for
   any transaction still open below the high watermark (``settled_ends``): a broker
   restarted uncleanly can leave one hanging, and reading short of it would reuse seqs its
   records hold (this producer's next commit marker would commit them too);
2. read the committed inbox offset and its metadata (after fencing: the older owner could
   still commit a transaction that moves it before);
3. when that metadata holds a tail mark (``checkpoint_plan.py``: sessions are checkpointed at
   rest points, so some have newer events), read the session partition from the mark to its
   end (``checkpoint_tail.py``: a bounded tail);
4. read partition p of the checkpoint topic (one record per session; what the cleaner has not
   compacted yet too): the index of every session, and the checkpoints of the busy ones and
   of those with newer events in the tail;
5. load those sessions (the tail's events folded onto their checkpoints), let each repair an
   open turn and continue pending work. Idle sessions stay on the topic until a command comes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from pipeline.adapters.kafka.checkpoints import CheckpointScan
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.core.checkpoint import SessionCheckpoint
from pipeline.core.errors import DshError, EventError
from pipeline.services.driver.checkpoint_tail import SessionTail
from pipeline.services.driver.checkpointing import (
    INVALID_LOG,
    decode_checkpoint,
    invalid_log_mark,
)
from pipeline.services.driver.inbox_offsets import tail_from_metadata
from pipeline.services.driver.partition import OwnedPartition, PartitionContext

log = logging.getLogger(__name__)

CommittedReader = Callable[[], Awaitable[tuple[int | None, str]]]


async def build_partition(ctx: PartitionContext, partition: int,
                          read_committed: CommittedReader) -> OwnedPartition:
    """Fence, read the partition's checkpoints, load and repair its busy sessions, resume."""
    producer = PartitionProducer(ctx.settings, group_id=ctx.group_id, partition=partition)
    await producer.start()
    owned: OwnedPartition | None = None
    try:
        committed, metadata = await read_committed()
        mark = tail_from_metadata(metadata)
        tail = await ctx.checkpoints.read_tail(partition, mark)
        scan = await ctx.checkpoints.scan(partition, tail)
        if not scan.migrated:
            log.info("partition %d has no driver checkpoints yet: reading its session "
                     "events once to write them", partition)
            scan = await ctx.checkpoints.migrate(producer, partition)
            ctx.metrics.partitions_migrated += 1
        owned = OwnedPartition(ctx, partition, producer, committed or 0, metadata)
        owned.index.update(scan.entries)
        await _load_sessions(owned, scan, tail)
        owned.start_sink()
        await _recover_sessions(owned)
        owned.start_evicting()
    except BaseException:  # cancelled (the partition left) or failed: nothing runs on
        if owned is not None:
            await owned.release(grace_s=0)  # its sink and the sessions' tasks stop too
        else:
            await producer.close()
        raise
    owned.accepting = True
    ctx.metrics.partitions_built += 1
    return owned


async def _load_sessions(owned: OwnedPartition, scan: CheckpointScan, tail: SessionTail
                         ) -> None:
    """Adopt the busy sessions and those with newer events in ``tail`` (folded on)."""
    ctx = owned.ctx
    dirty = list(tail.dirty(scan.entries))
    for session_id in [*scan.values, *(s for s in dirty if s not in scan.values)]:
        checkpoint = await _checkpoint_of(owned, session_id, scan.values.get(session_id))
        if session_id in tail.events and checkpoint.writer is None:
            try:
                tail.advance(checkpoint)
            except EventError as exc:  # marked as a log that does not rebuild, not driven
                log.error("session %s: its events after its checkpoint do not fold (%s): it "
                          "is marked %r and not driven", session_id, exc, INVALID_LOG)
                checkpoint = SessionCheckpoint(session_id, writer=invalid_log_mark(exc))
                owned.sink.track(checkpoint)
                owned.sink.plan.want(session_id)  # written with the first transaction
                owned.sink.wake()
        owned.adopt(checkpoint)
    owned.sink.plan.resume(dirty, tail.end)
    ctx.metrics.sessions_rebuilt += len(scan.values) + sum(
        1 for s in dirty if s not in scan.values)


async def _checkpoint_of(owned: OwnedPartition, session_id: str, value: bytes | None
                         ) -> SessionCheckpoint:
    if value is None:  # a session younger than its first checkpoint
        return SessionCheckpoint(session_id)
    checkpoint = decode_checkpoint(value)
    if checkpoint is None:  # above the record limit: its events, read whole
        checkpoint = await owned.ctx.checkpoints.from_session_topic(owned.partition, session_id)
    return checkpoint


async def _recover_sessions(owned: OwnedPartition) -> None:
    for slot in list(owned.sessions.values()):
        if slot.runner is None:
            continue
        before = slot.log.next_seq
        try:
            await slot.runner.recover()
        except DshError:
            raise  # the sink failed: the whole partition is retried
        except Exception as exc:  # a runner bug must not block the other sessions
            slot.failure = f"its crash repair failed: {type(exc).__name__}: {exc}"
            log.exception("session %s: crash repair failed", slot.session_id)
            owned.ctx.metrics.session_failures += 1
            continue
        if slot.log.next_seq != before:
            owned.ctx.metrics.turns_repaired += 1
        owned.drive(slot)  # continue work the rebuilt inbox lists still hold
