"""faust's changelog queue, without the drop of standby records when a recovery ends.

Every changelog record the consumer fetches for the tables' recovery and standby reads goes
through one queue (the table manager's ``changelog_queue``) to faust's reader
(``Recovery._slurp_changelogs``), which applies it and moves its partition's offset past it.
The queue is cleared whenever faust's flow control resumes, which its recovery does several
times per rebalance, and the last time *after* it resumed the standby partitions: it starts
their reads (``Recovery._restart_recovery``, "Starting standby partitions"), then, in
``Recovery.on_recovery_completed``, awaits the seek of the stream partitions to their
committed offsets (a broker round trip) and only then calls ``flow_control.resume()``. The
standby records fetched in between and not read yet are dropped; the consumer's position is
past them, so they are not fetched again, and the reader moves the partition's standby offset
past them with the next record it reads. On ``rocksdb://`` that offset is written into the
store with the next standby batch (``Store.apply_changelog_batch``), and a promotion of the
standby to active (its owner gone) recovers only what lies past it: a dropped record stays
missing for good (a session "unknown" on the new owner, whose only ``sessions`` record was
dropped; tests/services/processors/test_processors_rocksdb.py failed so under load).
``memory://`` stores no offset, so a promotion reads the whole changelog again and hides the
loss.

Rule: a clear while the flow is *suspended* (a rebalance: faust suspends, then clears) drops
every record, as in faust; the recovery then seeks every changelog partition to the offset
it has read to, so nothing is lost. A clear by a *resume* keeps the records of the current
consumer generation (fetched after their partition's seek of this generation, see below) and
lets the records waiting for room in the full queue in; it drops only those of an earlier
generation. Within a generation no changelog record is fetched before the recovery seeked
its partition: the flow is suspended from the rebalance until the first resume, and the
standby partitions stay paused until they are seeked. So every record kept is one faust's
reader could as well have read just before the resume: nothing is read that faust could not
read, and nothing the consumer fetched is lost.
"""

from __future__ import annotations

import logging
from typing import Any

from faust.tables.manager import TableManager
from mode.utils.queues import ThrowableQueue

from pipeline.adapters.faust import private_api

log = logging.getLogger(__name__)


def kept_on_resume(event: Any, generation: int) -> bool:
    """Whether a resume keeps this queued changelog record (of consumer ``generation``)."""
    return bool(event.message.generation_id == generation)


class ChangelogQueue(ThrowableQueue[Any]):
    """faust's changelog queue with the rule of this module."""

    def __init__(self, app: Any, maxsize: int) -> None:
        super().__init__(maxsize=maxsize, flow_control=app.flow_control, clear_on_resume=True)
        self.app = app
        self.kept = 0   # records a resume kept (faust would have dropped them)

    def clear(self) -> None:
        if not self.app.flow_control.is_active():   # a rebalance: as faust
            super().clear()
            return
        queued = private_api.queued_items(self)
        generation = self.app.consumer_generation_id
        kept = [event for event in queued if kept_on_resume(event, generation)]
        if len(kept) < len(queued):
            log.info("changelog queue: %d records of an earlier generation dropped",
                     len(queued) - len(kept))
        queued.clear()
        queued.extend(kept)
        if kept:
            log.info("changelog queue: %d records of this generation kept on a resume (faust "
                     "would drop them: a standby read would miss them)", len(kept))
        self.kept += len(kept)
        private_api.clear_thrown(self)
        private_api.wake_putters(self)   # faust cancels them: their records were lost too


class ChangelogTableManager(TableManager):
    """faust's table manager, whose changelog queue is a :class:`ChangelogQueue`."""

    _dsh_changelog_queue: ChangelogQueue | None = None

    @property
    def changelog_queue(self) -> ChangelogQueue:
        if self._dsh_changelog_queue is None:
            self._dsh_changelog_queue = ChangelogQueue(
                self.app, maxsize=self.app.conf.stream_buffer_maxsize)
        return self._dsh_changelog_queue
