"""Where a session's first event lies in the session topic, so that a reader of the whole
session (``export``, ``tail SESSION --from-beginning``) starts there, not at its partition's
first offset.

The processors publish it on every fleet record of the session (header
``dsh.session.first``, :func:`~pipeline.codec.records.session_first_offset`). The fleet topic
is keyed by session id like the session topic and has its partition count, so the session's
fleet record lies in the session's partition number: one partition of a compacted topic is
read (bounded by the sessions of that partition, not by their events).
"""

from __future__ import annotations

import logging

from pipeline.adapters.kafka.compacted import CompactedFollow
from pipeline.codec.records import record_key, session_first_offset
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings

log = logging.getLogger(__name__)


async def first_offset_of(settings: Settings, session_id: str) -> int | None:
    """The session-topic offset of the session's first event, as its latest fleet record
    says; None when there is none (no processors folded it yet, or older ones did) or the
    fleet topic cannot be read (e.g. no ACL): the reader then starts at the partition's start,
    slower and as exact."""
    key = record_key(session_id)
    found: int | None = None
    try:
        async with CompactedFollow(settings, [settings.topics.fleet], only_key=key) as follow:
            async for batch in follow.snapshot():
                for record in batch:
                    if record.key == key:
                        found = (None if record.value is None
                                 else session_first_offset(record.headers))
    except BrokerError as exc:
        log.info("session %s: where its first event lies is unknown (%s); reading its "
                 "partition from the start", session_id, exc)
        return None
    return found
