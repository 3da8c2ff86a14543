"""A session as the worker has folded it so far, read without an await.

The views (:mod:`.web`) and the session page (:mod:`.session_page`) read the same three
things: the session's state (the folder's cached one, ahead of the ``sessions`` table until
the next persist), the seq it expects next, and the ``nodes`` records its live surface
names. Read between two awaits of the folds, they agree: a fold records a node, for the
next persist, before it awaits anything.
"""

from __future__ import annotations

from typing import Any

from pipeline.services.processors.folding import SessionFolder
from pipeline.services.processors.session_state import (
    SessionState,
    SessionTables,
    next_expected,
)


def current_state(tables: SessionTables, folder: SessionFolder | None, session_id: str
                  ) -> SessionState | None:
    """The session as folded so far (None: it has no record here)."""
    if folder is not None:
        return folder.current(session_id)
    raw = tables.sessions.get(session_id)
    return None if raw is None else SessionState.from_json(session_id, raw)


def expected_seq(tables: SessionTables, folder: SessionFolder | None, session_id: str,
                 state: SessionState | None) -> int:
    """The seq the session expects next: its state's, or later chunks' (0: unknown)."""
    folded = next_expected(tables, session_id) if folder is None else folder.cursor(session_id)
    return max(folded, state.next_seq if state else 0)


def surface_nodes(tables: SessionTables, folder: SessionFolder | None, state: SessionState,
                  partition: int) -> list[tuple[int, Any]]:
    """Each live surface seq of ``state`` in surface order, with its ``nodes`` record as
    folded so far in ``partition`` (None where the table lacks it)."""
    found: list[tuple[int, Any]] = []
    for seq in state.surface.seqs():
        key = f"{state.session_id}/{seq}"
        found.append((seq, tables.nodes.get(key) if folder is None
                      else folder.node(partition, key)))
    return found
