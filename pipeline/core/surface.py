"""The surface fold: the ordered list of surface nodes and the messages they project to.

This is core's ONE surface fold: ``derive``, the driver's invariant check, replay, the
dashboard and the processors all fold with :class:`SurfaceFold`, with every rule. The
processors' slots (:mod:`pipeline.core.projection`) are a view of it: each node also carries
its *slot* (the seq of the event first appended at its place), and a fold serialises to its
live nodes only (:meth:`SurfaceFold.to_json`; with their messages for a fold that keeps them,
as a driver's session checkpoint does), so its state is bounded by the live surface, never by
history.

The surface is an ordered list of event seqs; only ``user/message``, ``assistant/message`` and
``tool/result`` join it. ``append`` puts the event's seq at the end; ``replace {start,end}``
removes the inclusive range of live nodes ``start..end`` (seqs, looked up on the surface) and
puts the new seq where the first removed node was. Derived order is surface order.

Cost: an append is O(1); a replace is O(surface length) (a list splice plus re-indexing the
nodes after it). :meth:`SurfaceFold.apply` returns a :class:`SurfaceChange` saying exactly
what changed, so a consumer can publish the change in O(size of the change).

Every check runs before any state changes (:meth:`SurfaceFold.plan`, then commit): a refused
event leaves the fold exactly as it was.

The tool-result replacement rules compare the replacing event with the node it shadows; a
node keeps, instead of its event, a digest of what such a replacement must keep equal
(:class:`ResultKey`; set only for ``tool/result`` nodes), so the fold holds nothing per
event that is no longer on the surface.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from pipeline.core.errors import CodecError
from pipeline.core.events import Event, JsonValue, Replace
from pipeline.core.rules import fail
from pipeline.core.types import SURFACE_TYPES
from pipeline.core.validation import projected_message

# A node's result key when it came from a serialised state that did not record one: the
# tool-result replacement rules are not checked against it (see SurfaceFold.from_json).
UNKNOWN_RESULT: Final = "?"


class ResultKey:
    """What a replacement of a ``tool/result`` node must keep equal: its data without the
    result's content, as a digest computed when first needed (a replacement, or the state
    serialised), after which the data is no longer held."""

    __slots__ = ("_data", "_digest")

    def __init__(self, data: Any = None, digest: str | None = None) -> None:
        self._data, self._digest = data, digest

    def digest(self) -> str:
        if self._digest is None:
            canonical = json.dumps(_canonical(_without_result_content(self._data)),
                                   sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            self._digest = hashlib.blake2b(canonical.encode(), digest_size=12).hexdigest()
            self._data = None
        return self._digest


@dataclass(frozen=True, slots=True)
class Appended:
    """A node appended at ``position`` (== surface length before). ``message`` None: the
    node projects to nothing (an assistant message with empty content). Its slot is its
    seq."""

    position: int
    seq: int
    message: JsonValue | None
    result: ResultKey | None = field(default=None, compare=False)   # tool/result only

    @property
    def slot(self) -> int:
        return self.seq


@dataclass(frozen=True, slots=True)
class Replaced:
    """Nodes ``removed_seqs`` (in surface order, starting at ``start_position``) were removed
    and the node ``seq`` now stands at ``start_position``."""

    start_position: int
    removed_seqs: tuple[int, ...]
    seq: int
    message: JsonValue | None
    removed_slots: tuple[int, ...] = field(default=(), compare=False)   # as removed_seqs
    result: ResultKey | None = field(default=None, compare=False)   # tool/result only

    @property
    def slot(self) -> int:
        """The new node's slot: the first removed node's."""
        return self.removed_slots[0] if self.removed_slots else self.removed_seqs[0]


SurfaceChange: TypeAlias = Appended | Replaced


@dataclass(frozen=True, slots=True)
class SurfaceNode:
    """One live node: the seq of its event and what it projects to (None: nothing, or not
    kept); ``slot`` and ``result`` (see :class:`ResultKey`) are what the rules and the slot
    view need."""

    seq: int
    message: JsonValue | None
    slot: int = field(default=-1, compare=False)
    result: ResultKey | None = field(default=None, compare=False)


class SurfaceFold:
    """The incremental fold alone. Results are tuples; fold state is never handed out.

    ``keep_messages=False``: nodes do not keep what they project to (the processors keep
    messages elsewhere); :meth:`messages` is then empty, the changes still carry them."""

    __slots__ = ("_cache", "_keep_messages", "_nodes", "_position")

    def __init__(self, *, keep_messages: bool = True) -> None:
        self._nodes: list[SurfaceNode] = []
        self._position: dict[int, int] = {}  # seq -> index in _nodes, for live nodes only
        self._keep_messages = keep_messages
        self._cache: tuple[JsonValue, ...] | None = ()

    def __len__(self) -> int:
        return len(self._nodes)

    def nodes(self) -> tuple[SurfaceNode, ...]:
        """The live nodes in surface order."""
        return tuple(self._nodes)

    def seqs(self) -> tuple[int, ...]:
        return tuple(node.seq for node in self._nodes)

    def slots(self) -> list[list[int]]:
        """The live nodes as ``[slot, seq]`` pairs in surface order (fresh lists)."""
        return [[node.slot, node.seq] for node in self._nodes]

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
        result = ResultKey(event.data) if event.type == "tool/result" else None
        op = event.surface_op
        if not isinstance(op, Replace):
            return Appended(len(self._nodes), event.seq, message, result)
        start = self._position.get(op.start)
        end = self._position.get(op.end)
        if start is None or end is None:
            missing = op.start if start is None else op.end
            fail(event, f"replace range {op.start}..{op.end}: seq {missing} is not a live "
                 "surface node", "replace-target-live")
        if start > end:
            fail(event, f"replace range {op.start}..{op.end}: start stands after end on the "
                 "surface", "replace-range-order")
        removed = self._nodes[start:end + 1]
        self._check_replace(event, removed, result)
        return Replaced(start, tuple(node.seq for node in removed), event.seq, message,
                        tuple(node.slot for node in removed), result)

    def _check_replace(self, event: Event, removed: list[SurfaceNode],
                       result: ResultKey | None) -> None:
        sources = set(event.source_event_seqs or ())
        missing = [node.seq for node in removed if node.seq not in sources]
        if missing:
            fail(event, f"sourceEventSeqs must name every shadowed node; missing {missing}",
                 "replace-sources")
        if event.type != "tool/result":
            return
        if len(removed) != 1:
            fail(event, f"a tool/result replacement shadows exactly one node, not "
                 f"{len(removed)}", "tool-result-replace-one")
        original = removed[0].result
        if original is None:
            fail(event, f"a tool/result replacement must shadow a tool/result, not the "
                 f"message at seq {removed[0].seq}", "tool-result-replace-target")
        if original.digest() == UNKNOWN_RESULT:
            return   # from a state that did not record it (see from_json)
        if result is None or original.digest() != result.digest():
            fail(event, "a tool/result replacement may change only the result's content",
                 "tool-result-replace-content-only")

    def commit(self, event: Event, change: SurfaceChange | None) -> None:
        """Apply a change :meth:`plan` returned for ``event`` (no checks, cannot fail)."""
        if change is None:
            return
        message = change.message if self._keep_messages else None
        node = SurfaceNode(change.seq, message, change.slot, change.result)
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

    @property
    def keeps_messages(self) -> bool:
        return self._keep_messages

    def copy(self) -> SurfaceFold:
        """An independent fold in the same state (nodes are immutable: shared, not copied)."""
        fold = SurfaceFold(keep_messages=self._keep_messages)
        fold._nodes = list(self._nodes)
        fold._position = dict(self._position)
        fold._cache = self._cache
        return fold

    def to_json(self, *, with_messages: bool = False) -> list[list[Any]]:
        """The live nodes, bounded by the live surface.

        Compact form (the default): ``[slot, seq]``, or ``[slot, seq, result]`` for a
        tool/result; messages are not serialised. ``with_messages``: every node is
        ``[slot, seq, result|null, message|null]`` (null message: the node projects to
        nothing), which only a fold that keeps messages can give (ValueError otherwise).
        """
        if with_messages:
            if not self._keep_messages:
                raise ValueError("a fold that does not keep messages cannot serialise them")
            return [[n.slot, n.seq, None if n.result is None else n.result.digest(), n.message]
                    for n in self._nodes]
        return [[n.slot, n.seq] if n.result is None else [n.slot, n.seq, n.result.digest()]
                for n in self._nodes]

    @classmethod
    def from_json(cls, raw: Any, *, keep_messages: bool | None = None) -> SurfaceFold:
        """A fold from :meth:`to_json`, in either form.

        The compact form gives a fold that does not keep messages. The earlier form
        ``{"nodes": [[slot, seq], ...], "ops": [...]}`` is read too: its nodes' result keys
        are unknown (the tool-result replacement rules are not checked against them).
        Entries of the ``with_messages`` form give a fold that keeps messages. An empty
        surface says neither, so ``keep_messages`` decides (None: infer from the entries;
        True: the ``with_messages`` form is required, else :class:`CodecError`).
        """
        if keep_messages is not False and isinstance(raw, list) and raw \
                and all(isinstance(e, list) and len(e) == 4 for e in raw):
            return cls._from_full(raw)
        if keep_messages:
            if raw == []:
                return cls(keep_messages=True)
            raise CodecError("a surface that keeps messages is a list of "
                             "[slot, seq, result|null, message|null] entries")
        return cls._from_compact(raw)

    @classmethod
    def _from_compact(cls, raw: Any) -> SurfaceFold:
        fold = cls(keep_messages=False)
        if raw is None:
            return fold
        if isinstance(raw, dict):
            entries = [[*node[:2], UNKNOWN_RESULT] for node in raw["nodes"]]
        else:
            entries = raw
        fold._nodes = [SurfaceNode(int(e[1]), None, int(e[0]),
                                   ResultKey(digest=str(e[2]))
                                   if len(e) > 2 and e[2] is not None else None)
                       for e in entries]
        fold._position = {node.seq: index for index, node in enumerate(fold._nodes)}
        fold._cache = None
        return fold

    @classmethod
    def _from_full(cls, entries: list[list[Any]]) -> SurfaceFold:
        """A fold keeping messages; the shapes are checked (a seq must not repeat)."""
        fold = cls(keep_messages=True)
        for slot, seq, digest, message in entries:
            if type(slot) is not int or type(seq) is not int or seq < 0 \
                    or not (digest is None or isinstance(digest, str)):
                raise CodecError(f"surface entry [{slot!r}, {seq!r}, {digest!r}, ...]: slot "
                                 "and seq must be integers, the result a string or null")
            fold._nodes.append(SurfaceNode(seq, message, slot,
                                           None if digest is None else ResultKey(digest=digest)))
        fold._position = {node.seq: index for index, node in enumerate(fold._nodes)}
        if len(fold._position) != len(fold._nodes):
            raise CodecError("surface entries repeat a seq")
        fold._cache = None
        return fold


def _canonical(value: Any) -> Any:
    """Equal JSON values compare equal after this (an integral float is its int)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _canonical(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    return value


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
        node = SurfaceNode(change.seq, change.message, change.slot, change.result)
        if isinstance(change, Appended):
            nodes.append(node)
        else:
            start = change.start_position
            nodes[start:start + len(change.removed_seqs)] = [node]
    return nodes


def derive_from_nodes(nodes: Iterable[SurfaceNode]) -> tuple[JsonValue, ...]:
    return tuple(node.message for node in nodes if node.message is not None)
