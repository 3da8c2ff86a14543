"""Where a dashboard session page starts, answered from the worker's tables in O(session).

``GET /sessions/{id}/page`` (routed to the worker that owns the session's partition) gives
the session's live surface as ``[slot, seq]`` nodes with their messages, the seq the
session expects next, and a session-topic offset from which every event the answer does
not hold follows. The dashboard then reads only the partition's records after that offset,
never the derived-messages topic (:mod:`pipeline.services.dashboard.session_start`).

The rule that makes the answer consistent: every event below the offset is in the state
read here, so an event the state lacks lies at or after it. The offset is the later of two
that keep the rule:

- the partition's **committed** offset: a worker commits an offset only after the batches
  below it are persisted, and its in-memory states never fall behind what is persisted (a
  batch given up falls back to the tables);
- the offset after the partition's last batch folded whole (``SessionFolder.folded_to``,
  cleared whenever cached state is given up): usually far closer to the end, since commits
  follow a commit interval behind the folds.

The answer is read without an await, between two awaits of the folds, so the state, the
nodes and the cursor agree (a batch folded part way is read again from its start: its
events the state holds carry seqs below the next one and are skipped by the page).

It refuses (``None`` and a reason, answered 503) when the worker cannot vouch for it: the
partition is not this worker's active one, its recovery is not over, it has no committed
offset yet, or the ``nodes`` table lacks a message the surface names. The dashboard then
reads the derived-messages topic as before.
"""

from __future__ import annotations

from pipeline.adapters.faust.transport import committed_offset
from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.core.events import JsonValue
from pipeline.services.processors.folded_session import (
    current_state,
    expected_seq,
    surface_nodes,
)
from pipeline.services.processors.folding import SessionFolder
from pipeline.services.processors.session_state import SessionTables
from pipeline.services.processors.worker import Processors


def session_page(processors: Processors, session_id: str
                 ) -> tuple[dict[str, JsonValue] | None, str]:
    """The page start of ``session_id`` (see the module doc), or None and why not."""
    settings = processors.settings
    topic = settings.topics.session_events
    state = current_state(processors.tables, processors.folder, session_id)
    partition = (state.partition if state is not None and state.partition >= 0
                 else partition_for(session_id, settings.partitions))
    if partition not in processors.active_partitions(topic):
        return None, f"partition {partition} is not an active partition of this worker"
    if processors.recovery()["in_recovery"]:
        return None, "the worker is recovering its tables"
    committed = committed_offset(processors.app, topic, partition)
    if committed is None:
        return None, f"partition {partition} has no committed offset yet"
    body = page_answer(processors.tables, processors.folder, session_id, partition, committed)
    if body is None:
        return None, "the nodes table lacks a message the session's surface names"
    return body, ""


def page_answer(tables: SessionTables, folder: SessionFolder | None, session_id: str,
                partition: int, committed: int) -> dict[str, JsonValue] | None:
    """The answer from the fold so far, given the partition's committed offset; None when
    the ``nodes`` table lacks a message the surface names. Never awaits."""
    state = current_state(tables, folder, session_id)
    found = surface_nodes(tables, folder, state, partition) if state is not None else []
    if any(node is None for _seq, node in found):
        return None
    nodes = state.surface.slots() if state is not None else []
    messages: list[JsonValue] = [node.get("message") for _seq, node in found]
    next_seq = expected_seq(tables, folder, session_id, state)
    first = state.first_offset if state is not None else 0
    folded = folder.folded_to.get(partition, -1) if folder is not None else -1
    return {"session": session_id, "nextSeq": next_seq, "nodes": list(nodes),
            "messages": messages, "partition": partition,
            "fromOffset": max(committed, folded + 1, first)}

