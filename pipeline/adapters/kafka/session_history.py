"""Read one session's surface events back from the session topic (read committed).

Used by the processors to answer "the messages as of event N" from the log itself, so that
their per-session state keeps no history: the read starts at the offset of the session's
first event (which the processors keep) and stops at the first event of that session past
seq N, or at the partition's end offset taken when the read starts.

Only surface records (``dsh.type`` header) of the session (record key) are decoded; a
seq seen twice (a redelivered write) is kept once.
"""

from __future__ import annotations

from typing import Any

from pipeline.adapters.kafka.session_reader import Decoder, read_committed
from pipeline.codec.records import HEADER_SEQ, HEADER_TYPE
from pipeline.core.events import Event
from pipeline.core.types import SURFACE_TYPES
from pipeline.settings import Settings

_SURFACE_TYPE_BYTES = frozenset(t.encode() for t in SURFACE_TYPES)


async def read_surface_events(settings: Settings, topic: str, partition: int,
                              session_id: str, start_offset: int, last_seq: int,
                              decode: Decoder, *, timeout_s: float = 300.0) -> list[Event]:
    """The surface events of ``session_id`` with seq <= ``last_seq``, in seq order."""
    key = session_id.encode()
    found: dict[int, Event] = {}

    def visit(record: Any) -> bool:
        """Keep ``record`` if it is one of the session's surface events; False past last_seq."""
        if record.key != key or record.value is None:
            return True
        headers = dict(record.headers)
        seq, type_ = headers.get(HEADER_SEQ), headers.get(HEADER_TYPE)
        if seq is not None and seq.isdigit() and int(seq) > last_seq:
            return False
        if type_ is not None and type_ not in _SURFACE_TYPE_BYTES:
            return True
        _sid, event = decode(record.value)
        if event.seq > last_seq:
            return False
        found.setdefault(event.seq, event)
        return True

    await read_committed(settings, topic, partition, visit, start_offset=start_offset,
                         what=f"read session {session_id[:80]!r} from {topic}[{partition}]",
                         timeout_s=timeout_s)
    return [found[seq] for seq in sorted(found)]
