"""Packed chunk rows of dsh session files (format 0): expanding one, and packing runs of
``assistant/chunk`` deltas into them (the layout: :mod:`pipeline.codec.sessionfile`).

A row stands for consecutive ``assistant/chunk`` events of one block: member k is seq
``seq0+k`` at ``time0 + dt[0] + ... + dt[k-1]``. Packing takes runs of at least
:data:`PACK_MIN_RUN` deltas of one block (same kind, turn, step, index; for tool calls the
same id and name) whose events carry nothing else, at most :data:`PACK_MAX_RUN` per row, as
dsh does; a shorter run stays events.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from pipeline.core.errors import SessionFileError
from pipeline.core.events import Event, JsonValue

PACKED_TYPES: Final = {"text-chunks": "text-delta", "reasoning-chunks": "reasoning-delta",
                       "tool-call-chunks": "tool-call-delta"}
PACK_MIN_RUN: Final = 3
PACK_MAX_RUN: Final = 1024


def _row_error(row_type: str, detail: str) -> SessionFileError:
    return SessionFileError(f"malformed {row_type} row: {detail}")


def expand_packed_row(row: dict[str, JsonValue]) -> list[Event]:
    """The ``assistant/chunk`` events a packed row stands for (checks the row's shape)."""
    row_type = str(row["type"])
    if set(row) != {"type", "seq0", "time0", "data"}:
        raise _row_error(row_type, f"keys must be type, seq0, time0, data; got {sorted(row)}")
    seq0, time0, data = row["seq0"], row["time0"], row["data"]
    if type(seq0) is not int or seq0 < 0 or type(time0) is not int:
        raise _row_error(row_type, "seq0 must be a non-negative integer and time0 an integer")
    tool = row_type == "tool-call-chunks"
    members_key = "args" if tool else "texts"
    allowed = {"turn", "step", "index", "dt", members_key} | ({"id", "name"} if tool else set())
    if not isinstance(data, dict) or not set(data) <= allowed or (
            {"turn", "step", "index", "dt", members_key} - set(data)):
        raise _row_error(row_type, f"data keys must be {sorted(allowed)}")
    members, gaps = data[members_key], data["dt"]
    if (not isinstance(members, list) or not members
            or not all(isinstance(m, str) for m in members)):
        raise _row_error(row_type, f"{members_key} must be a non-empty array of strings")
    if (not isinstance(gaps, list) or len(gaps) != len(members) - 1
            or not all(type(g) is int for g in gaps)):
        raise _row_error(row_type, f"dt must hold {len(members) - 1} integers")
    if not all(type(data[k]) is int for k in ("turn", "step", "index")):
        raise _row_error(row_type, "turn, step and index must be integers")
    if tool and (not isinstance(data.get("id"), str)
                 or ("name" in data and not isinstance(data["name"], str))):
        raise _row_error(row_type, "id (and name, when present) must be strings")
    return _expand(row_type, seq0, time0, data, members, gaps)


def _expand(row_type: str, seq0: int, time0: int, data: dict[str, Any],
            members: list[str], gaps: list[int]) -> list[Event]:
    kind = PACKED_TYPES[row_type]
    turn, step, index = data["turn"], data["step"], data["index"]
    events: list[Event] = []
    time = time0
    for k, member in enumerate(members):
        if k:
            time += gaps[k - 1]
        if kind == "tool-call-delta":
            chunk: dict[str, JsonValue] = {"type": kind, "index": index, "id": data["id"]}
            if "name" in data:
                chunk["name"] = data["name"]
            chunk["argumentsDelta"] = member
        else:
            chunk = {"type": kind, "index": index, "text": member}
        events.append(Event("assistant/chunk", seq0 + k, time,
                            {"turn": turn, "step": step, "chunk": chunk}))
    return events

def pack_chunks(events: Iterable[Event]) -> Iterator[Event | dict[str, JsonValue]]:
    """``events`` in order, each run of packable deltas replaced by its packed rows."""
    run: list[tuple[Event, _Member]] = []
    for event in events:
        member = _packable(event)
        if run and (member is None or not _continues(run[-1], event, member)):
            yield from _flush_run(run)
            run = []
        if member is None:
            yield event
        else:
            run.append((event, member))
    yield from _flush_run(run)


@dataclass(frozen=True, slots=True)
class _Member:
    kind: str
    turn: int
    step: int
    index: int
    text: str
    call_id: str | None = None
    name: str | None = None
    has_name: bool = False


def _packable(event: Event) -> _Member | None:
    """The delta an event holds if packing it loses nothing; None otherwise."""
    if (event.type != "assistant/chunk" or event.surface_op is not None
            or event.source_event_seqs is not None or event.ignorable is not None):
        return None
    data = event.data
    if not isinstance(data, dict) or set(data) != {"turn", "step", "chunk"}:
        return None
    turn, step, chunk = data["turn"], data["step"], data["chunk"]
    if type(turn) is not int or type(step) is not int or not isinstance(chunk, dict):
        return None
    kind, index = chunk.get("type"), chunk.get("index")
    if type(index) is not int:
        return None
    if kind in ("text-delta", "reasoning-delta") and set(chunk) == {"type", "index", "text"}:
        text = chunk["text"]
        return _Member(kind, turn, step, index, text) if isinstance(text, str) else None
    if kind != "tool-call-delta":
        return None
    has_name = "name" in chunk
    keys = {"type", "index", "id", "argumentsDelta"} | ({"name"} if has_name else set())
    if set(chunk) != keys or not isinstance(chunk["id"], str) or not isinstance(
            chunk["argumentsDelta"], str) or (has_name and not isinstance(chunk["name"], str)):
        return None
    return _Member(kind, turn, step, index, chunk["argumentsDelta"], chunk["id"],
                   chunk.get("name"), has_name)


def _continues(previous: tuple[Event, _Member], event: Event, member: _Member) -> bool:
    before_event, before = previous
    return (event.seq == before_event.seq + 1 and member.kind == before.kind
            and member.turn == before.turn and member.step == before.step
            and member.index == before.index and member.call_id == before.call_id
            and member.has_name == before.has_name and member.name == before.name)


def _flush_run(run: list[tuple[Event, _Member]]) -> Iterator[Event | dict[str, JsonValue]]:
    start = 0
    while len(run) - start >= PACK_MIN_RUN:
        piece = run[start:start + PACK_MAX_RUN]
        yield _packed_row(piece)
        start += len(piece)
    for event, _ in run[start:]:
        yield event


def _packed_row(run: list[tuple[Event, _Member]]) -> dict[str, JsonValue]:
    first_event, first = run[0]
    gaps = [run[i][0].time - run[i - 1][0].time for i in range(1, len(run))]
    texts = [member.text for _, member in run]
    data: dict[str, JsonValue] = {"turn": first.turn, "step": first.step,
                                  "index": first.index, "dt": gaps}
    if first.kind == "tool-call-delta":
        data["id"] = first.call_id
        if first.has_name:
            data["name"] = first.name
        data["args"] = texts
        row_type = "tool-call-chunks"
    else:
        data["texts"] = texts
        row_type = "text-chunks" if first.kind == "text-delta" else "reasoning-chunks"
    return {"type": row_type, "seq0": first_event.seq, "time0": first_event.time, "data": data}
