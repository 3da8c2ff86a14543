"""Taking over an inbox partition: fence, read the checkpoints, load the busy sessions.

:func:`build_partition` never reads the session topic from offset 0, except once per
partition of a topic written by older code (the migration, ``checkpointing.py``):

1. start the partition's transactional producer: this fences the older owner (its open
   transaction is aborted), so what is read next is final;
2. read the committed inbox offset and its metadata (after fencing: the older owner could
   still commit a transaction that moves it before);
3. read partition p of the checkpoint topic (one record per session; what the cleaner has not
   compacted yet too): the index of every session, and the checkpoints of the busy ones;
4. load the busy sessions (a turn open, or waking inbox work), let each repair an open turn
   and continue pending work. Idle sessions stay on the topic until a command comes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.core.errors import DshError
from pipeline.services.driver.checkpointing import decode_checkpoint
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
        scan = await ctx.checkpoints.scan(partition)
        if not scan.migrated:
            log.info("partition %d has no driver checkpoints yet: reading its session "
                     "events once to write them", partition)
            scan = await ctx.checkpoints.migrate(producer, partition)
            ctx.metrics.partitions_migrated += 1
        owned = OwnedPartition(ctx, partition, producer, committed or 0, metadata)
        owned.index.update(scan.entries)
        for session_id, value in scan.values.items():
            checkpoint = decode_checkpoint(value)
            if checkpoint is None:  # above the record limit: its events, read whole
                checkpoint = await ctx.checkpoints.from_session_topic(partition, session_id)
            owned.adopt(checkpoint)
        ctx.metrics.sessions_rebuilt += len(scan.values)
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
