"""Reading a derived-messages version back and comparing it with a rebuild.

With the processors live, the active version keeps changing while a rebuild reads the log up
to a fixed end: a session that received surface events meanwhile is at another point in the
two (its last change seq differs), so it is not compared but counted as moved. Every other
session must be equal message for message; each difference is one line. The last change seq
of a session on a compacted topic is the largest ``changeSeq`` left: every surface event
that changes anything writes at least one non-tombstone record carrying its seq (an append
its own slot, a replace the slot it keeps).

Values are ``dsh.DerivedMessageChange`` Avro records (either framing; JSON objects written
before the outputs were Avro are read too, :class:`pipeline.codec.outputs.OutputDecoder`).
Registry ids are resolved through the settings' registry. A record that does not decode
(or whose schema id the registry cannot give), or whose key is not ``<session>/<slot>``, is
skipped and listed in :attr:`VersionContent.problems` (never a crash, never silently).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from pipeline.adapters.kafka.topic_scan import TopicScan
from pipeline.adapters.registry.outputs import output_decoder
from pipeline.codec.outputs import DERIVED_MESSAGE_CHANGE, OutputDecoder
from pipeline.codec.records import ConsumedRecord
from pipeline.core.errors import DshError
from pipeline.core.events import JsonValue, dumps_json
from pipeline.core.projection import parse_slot_key, rebuild_conversations
from pipeline.settings import Settings

Conversations = dict[str, list[JsonValue]]
MAX_PROBLEMS: Final = 1000  # lines kept; ``undecodable`` counts them all


@dataclass(slots=True)
class VersionContent:
    """A version as its compacted topic holds it."""

    conversations: Conversations = field(default_factory=dict)
    last_change: dict[str, int] = field(default_factory=dict)  # session -> max changeSeq
    undecodable: int = 0  # records skipped: value or key not a derived-message change
    problems: list[str] = field(default_factory=list)  # one line per skipped record


async def read_version(settings: Settings, topic: str, decoder: OutputDecoder | None = None
                       ) -> VersionContent | None:
    """What a compacted derived-messages topic holds (None: no such topic). Registry ids
    (Confluent framing) are resolved through the settings' registry unless ``decoder``."""
    decoder = decoder or output_decoder(settings)
    content = VersionContent()
    pairs: list[tuple[str, JsonValue | None]] = []
    async with TopicScan(settings, topic) as scan:
        if not scan.exists:
            return None
        async for run in scan.client_batches():  # read, not kept: no copy
            for record in run:
                pair = _decoded(record, decoder, content)
                if pair is not None:
                    pairs.append(pair)
    content.conversations = {sid: list(m) for sid, m in rebuild_conversations(pairs).items()}
    live: dict[str, JsonValue | None] = {}
    for key, value in pairs:
        live[key] = value
    for key, value in live.items():
        if isinstance(value, Mapping) and isinstance(value.get("changeSeq"), int):
            session_id, _slot = parse_slot_key(key)
            seq = int(value["changeSeq"])
            content.last_change[session_id] = max(seq, content.last_change.get(session_id, -1))
    return content


def _decoded(record: ConsumedRecord, decoder: OutputDecoder, content: VersionContent
             ) -> tuple[str, JsonValue | None] | None:
    """(slot key, change or None for a tombstone); None when the record is skipped."""
    try:
        key = record.key.decode("utf-8") if record.key else ""
        parse_slot_key(key)
        return key, decoder.decode(record.value, DERIVED_MESSAGE_CHANGE)
    except (DshError, UnicodeDecodeError) as exc:  # codec, key, or registry unreachable
        content.undecodable += 1
        if len(content.problems) < MAX_PROBLEMS:
            content.problems.append(f"{record.topic}[{record.partition}]@{record.offset}: "
                                    f"skipped, not a derived-message change: {exc}")
        return None


async def read_conversations(settings: Settings, topic: str) -> Conversations | None:
    """The conversations a compacted derived-messages topic holds (None: no such topic)."""
    content = await read_version(settings, topic)
    return None if content is None else content.conversations


def moved_sessions(live: Mapping[str, int], new: Mapping[str, int]) -> set[str]:
    """Sessions present in both whose last change seq differs (changed during the rebuild)."""
    return {sid for sid in set(live) & set(new) if live[sid] != new[sid]}


def differences(live: Mapping[str, Sequence[JsonValue]], new: Mapping[str, Sequence[JsonValue]],
                live_name: str = "live", *, skip: frozenset[str] | set[str] = frozenset()
                ) -> list[str]:
    """Every difference between two sets of conversations, one line each (sessions in
    ``skip`` left out)."""
    found: list[str] = []
    for sid in sorted((set(live) | set(new)) - set(skip)):
        a, b = live.get(sid), new.get(sid)
        if a is None or b is None:
            which = live_name if a is None else "new version"
            found.append(f"{sid}: missing in the {which}")
            continue
        for index in range(max(len(a), len(b))):
            x = a[index] if index < len(a) else None
            y = b[index] if index < len(b) else None
            if x != y:
                found.append(f"{sid}: message {index} differs: {live_name} "
                             f"{_short(x)} != new {_short(y)}")
    return found


def _short(message: JsonValue | None) -> str:
    text = "(none)" if message is None else dumps_json(message)
    return text if len(text) <= 160 else text[:157] + "..."
