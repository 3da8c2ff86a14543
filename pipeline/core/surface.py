"""The surface fold: the ordered list of surface nodes and the messages they project to.

The surface is an ordered list of event seqs; only ``user/message``, ``assistant/message`` and
``tool/result`` join it. ``append`` puts the event's seq at the end; ``replace {start,end}``
removes the inclusive range of live nodes ``start..end`` (seqs, looked up on the surface) and
puts the new seq where the first removed node was. Derived order is surface order.

Cost: an append is O(1); a replace is O(surface length) (a list splice plus re-indexing the
nodes after it). :meth:`SurfaceFold.apply` returns a :class:`SurfaceChange` saying exactly
what changed, so a consumer can publish the change in O(size of the change).

Every check runs before any state changes (:meth:`SurfaceFold.plan`, then commit): a refused
event leaves the fold exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from pipeline.core.events import Event, JsonValue, Replace
from pipeline.core.rules import fail
from pipeline.core.types import SURFACE_TYPES
from pipeline.core.validation import projected_message


@dataclass(frozen=True, slots=True)
class Appended:
    """A node appended at ``position`` (== surface length before). ``message`` None: the
    node projects to nothing (an assistant message with empty content)."""

    position: int
    seq: int
    message: JsonValue | None


@dataclass(frozen=True, slots=True)
class Replaced:
    """Nodes ``removed_seqs`` (in surface order, starting at ``start_position``) were removed
    and the node ``seq`` now stands at ``start_position``."""

    start_position: int
    removed_seqs: tuple[int, ...]
    seq: int
    message: JsonValue | None


SurfaceChange: TypeAlias = Appended | Replaced


@dataclass(frozen=True, slots=True)
class SurfaceNode:
    """One live node: the seq of its event and what it projects to (None: nothing)."""

    seq: int
    message: JsonValue | None


class SurfaceFold:
    """The incremental fold alone. Results are tuples; fold state is never handed out."""

    __slots__ = ("_cache", "_events_by_seq", "_nodes", "_position")

    def __init__(self) -> None:
        self._nodes: list[SurfaceNode] = []
        self._position: dict[int, int] = {}  # seq -> index in _nodes, for live nodes only
        self._events_by_seq: dict[int, Event] = {}  # surface events ever folded (for rules)
        self._cache: tuple[JsonValue, ...] | None = ()

    def __len__(self) -> int:
        return len(self._nodes)

    def nodes(self) -> tuple[SurfaceNode, ...]:
        """The live nodes in surface order."""
        return tuple(self._nodes)

    def seqs(self) -> tuple[int, ...]:
        return tuple(node.seq for node in self._nodes)

    def messages(self) -> tuple[JsonValue, ...]:
        """The derived messages now: built once after a change, then cached."""
        if self._cache is None:
            self._cache = tuple(n.message for n in self._nodes if n.message is not None)
        return self._cache

    def plan(self, event: Event) -> SurfaceChange | None:
        """Check ``event`` against the live surface and say what it would change (nothing yet).

        None when the event does not touch the surface. Raises :class:`EventError`.
        """
        if event.type not in SURFACE_TYPES or event.surface_op is None:
            return None
        message = projected_message(event)
        op = event.surface_op
        if not isinstance(op, Replace):
            return Appended(len(self._nodes), event.seq, message)
        start = self._position.get(op.start)
        end = self._position.get(op.end)
        if start is None or end is None:
            missing = op.start if start is None else op.end
            fail(event, f"replace range {op.start}..{op.end}: seq {missing} is not a live "
                 "surface node", "replace-target-live")
        if start > end:
            fail(event, f"replace range {op.start}..{op.end}: start stands after end on the "
                 "surface", "replace-range-order")
        removed = tuple(node.seq for node in self._nodes[start:end + 1])
        self._check_replace(event, removed)
        return Replaced(start, removed, event.seq, message)

    def _check_replace(self, event: Event, removed: tuple[int, ...]) -> None:
        sources = set(event.source_event_seqs or ())
        missing = [seq for seq in removed if seq not in sources]
        if missing:
            fail(event, f"sourceEventSeqs must name every shadowed node; missing {missing}",
                 "replace-sources")
        if event.type != "tool/result":
            return
        if len(removed) != 1:
            fail(event, f"a tool/result replacement shadows exactly one node, not "
                 f"{len(removed)}", "tool-result-replace-one")
        original = self._events_by_seq[removed[0]]
        if original.type != "tool/result":
            fail(event, f"a tool/result replacement must shadow a tool/result, not "
                 f"{original.type} (seq {original.seq})", "tool-result-replace-target")
        if _without_result_content(original.data) != _without_result_content(event.data):
            fail(event, "a tool/result replacement may change only the result's content",
                 "tool-result-replace-content-only")

    def commit(self, event: Event, change: SurfaceChange | None) -> None:
        """Apply a change :meth:`plan` returned for ``event`` (no checks, cannot fail)."""
        if change is None:
            return
        self._events_by_seq[event.seq] = event
        node = SurfaceNode(change.seq, change.message)
        if isinstance(change, Appended):
            self._position[change.seq] = len(self._nodes)
            self._nodes.append(node)
            if self._cache is not None and node.message is not None:
                self._cache = None
            return
        start = change.start_position
        for seq in change.removed_seqs:
            del self._position[seq]
        self._nodes[start:start + len(change.removed_seqs)] = [node]
        for index in range(start, len(self._nodes)):
            self._position[self._nodes[index].seq] = index
        self._cache = None

    def apply(self, event: Event) -> SurfaceChange | None:
        """Plan and commit: what ``event`` changed on the surface (None: nothing)."""
        change = self.plan(event)
        self.commit(event, change)
        return change


def _without_result_content(data: Any) -> Any:
    """``data`` with ``message.content[0].content`` blanked: what must stay the same."""
    if not isinstance(data, dict) or not isinstance(data.get("message"), dict):
        return data
    message = dict(data["message"])
    content = message.get("content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        message["content"] = [{**content[0], "content": None}, *content[1:]]
    elif "content" in message:
        message["content"] = None  # simplified tool message: content is the result itself
    return {**data, "message": message}


def apply_changes(base: Sequence[SurfaceNode], changes: Iterable[SurfaceChange]) -> list[
        SurfaceNode]:
    """Replay ``changes`` onto a copy of ``base`` (used to rebuild the surface at a prefix)."""
    nodes = list(base)
    for change in changes:
        node = SurfaceNode(change.seq, change.message)
        if isinstance(change, Appended):
            nodes.append(node)
        else:
            start = change.start_position
            nodes[start:start + len(change.removed_seqs)] = [node]
    return nodes


def derive_from_nodes(nodes: Iterable[SurfaceNode]) -> tuple[JsonValue, ...]:
    return tuple(node.message for node in nodes if node.message is not None)
