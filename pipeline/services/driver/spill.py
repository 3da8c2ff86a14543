"""dsh's spill policy for tool results: the model sees a bounded preview, the full text is
kept outside the log (docs/large-content.md).

Follows dsh's ``spill-policy`` (a ``tools/post-execute`` transformer of its tool registry,
``maxInlineBytes`` 50,000 in its base bundle) and its ``retention`` head/tail preview:

- only plain-text results (every block ``text``) are spilled; the blocks' texts are joined;
- a result whose UTF-8 size is at most ``inline_bytes`` is left alone;
- otherwise the whole text is saved to the spill store, and the result becomes one text
  block: a head/tail preview, a blank line, then the notice ``(Omitted N bytes. Full
  formatted result stored at: <locator>. <how to retrieve it>)``. The notice's size, priced
  at the whole text's byte count, is reserved out of ``inline_bytes``; the rest is split
  half head (rounded up), half tail, each cut on a UTF-8 boundary, and N counts the bytes
  actually left out. The replacement is never larger than ``inline_bytes``;
- a failure to spill never turns a successful call into an error: the original is kept.

The log must also hold every result whole in one record, which dsh's local files need not:
a result that still would not fit the record limit (the spill failed, or it has non-text
blocks) becomes an error result ``TOOL_RESULT_TOO_LARGE`` that says so. So no tool result
ever reaches the producer above the limit, and none is written half.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final

from pipeline.adapters.kafka.spill import save_spill
from pipeline.core.events import JsonValue
from pipeline.core.turn_effects import ToolOutcome
from pipeline.settings import Settings

log = logging.getLogger(__name__)

RESULT_TOO_LARGE: Final = ("ToolResultTooLargeError", "TOOL_RESULT_TOO_LARGE")
# Room for the tool/result event's envelope, ids, error and meta around its content.
EVENT_HEADROOM_BYTES: Final = 64 * 1024
RETRIEVAL_HINT: Final = ("It is not in this conversation; operators read it with "
                         "`dsh-pipeline export --spill-dir` or pipeline.sdk.read_spill")


@dataclass(frozen=True, slots=True)
class SpilledText:
    """What the store gives back for a saved text: its locator and the log's reference."""

    locator: str
    meta: JsonValue


SaveText = Callable[[str], Awaitable[SpilledText]]


@dataclass(frozen=True, slots=True)
class Preview:
    """A head/tail preview of a text and the number of its UTF-8 bytes left out."""

    text: str
    omitted_bytes: int


def head_tail_preview(text: str, budget: int) -> Preview:
    """The first ``ceil(budget/2)`` and last ``floor(budget/2)`` UTF-8 bytes of ``text``.

    Each cut moves to a character boundary (never half a character), and ``omitted_bytes``
    counts what is actually left out, boundary trims included.
    """
    data = text.encode("utf-8")
    head_bytes, tail_bytes = (budget + 1) // 2, budget // 2
    if len(data) <= head_bytes + tail_bytes:
        return Preview(text, 0)
    head = data[:head_bytes].decode("utf-8", errors="ignore")
    tail_start = len(data) - tail_bytes
    while tail_start < len(data) and data[tail_start] & 0xC0 == 0x80:
        tail_start += 1   # skip continuation bytes: start on a character
    tail = data[tail_start:].decode("utf-8")
    kept = len(head.encode("utf-8")) + (len(data) - tail_start)
    return Preview(head + tail, len(data) - kept)


def spill_notice(omitted_bytes: int, locator: str) -> str:
    """dsh's notice after a preview: how much is left out, where it is, how to get it."""
    return (f"(Omitted {omitted_bytes} bytes. Full formatted result stored at: {locator}. "
            f"{RETRIEVAL_HINT}.)")


def replacement_text(text: str, total_bytes: int, locator: str, inline_bytes: int
                     ) -> str | None:
    """Preview + blank line + notice within ``inline_bytes``; None when even the notice
    alone would not fit (then the result is kept as it is, as dsh does)."""
    reserve = len(spill_notice(total_bytes, locator).encode("utf-8")) + 2
    preview = head_tail_preview(text, max(0, inline_bytes - reserve))
    notice = spill_notice(preview.omitted_bytes, locator)
    replaced = f"{preview.text}\n\n{notice}" if preview.text else notice
    return replaced if len(replaced.encode("utf-8")) <= inline_bytes else None


def plain_text(content: tuple[JsonValue, ...]) -> str | None:
    """The blocks' texts joined, or None when any block is not ``text``."""
    parts: list[str] = []
    for block in content:
        if not (isinstance(block, Mapping) and block.get("type") == "text"
                and isinstance(block.get("text"), str)):
            return None
        parts.append(block["text"])
    return "".join(parts)


class SpillPolicy:
    """Bounds tool results: spill above ``inline_bytes``, refuse above the record limit."""

    def __init__(self, save: SaveText | None, *, inline_bytes: int,
                 max_record_bytes: int) -> None:
        self._save = save
        self.inline_bytes = inline_bytes
        self.max_content_bytes = max_record_bytes - EVENT_HEADROOM_BYTES
        self.spilled = 0
        self.refused = 0

    async def bound(self, tool: str, outcome: ToolOutcome) -> ToolOutcome:
        """The outcome the log keeps and the model sees for ``tool``'s ``outcome``."""
        text = plain_text(outcome.content)
        if text is not None:
            total = len(text.encode("utf-8"))
            if total <= self.inline_bytes:
                return outcome
            spilled = await self._spill(tool, text, total, outcome)
            if spilled is not None:
                return spilled
        return self._refused_if_too_large(tool, outcome)

    async def _spill(self, tool: str, text: str, total: int, outcome: ToolOutcome
                     ) -> ToolOutcome | None:
        if self._save is None:
            return None
        try:
            saved = await self._save(text)
        except Exception as exc:  # dsh: a spill failure keeps the original result
            log.warning("spill of a %d-byte %s result failed: %s", total, tool, exc)
            return None
        replaced = replacement_text(text, total, saved.locator, self.inline_bytes)
        if replaced is None:
            log.warning("the spill notice for %s does not fit %d bytes; result kept",
                        tool, self.inline_bytes)
            return None
        self.spilled += 1
        meta = dict(outcome.meta) if isinstance(outcome.meta, Mapping) else (
            {} if outcome.meta is None else {"tool": outcome.meta})
        meta["spill"] = saved.meta
        return ToolOutcome(({"type": "text", "text": replaced},), outcome.is_error,
                           outcome.error, meta=meta)

    def _refused_if_too_large(self, tool: str, outcome: ToolOutcome) -> ToolOutcome:
        size = len(json.dumps(outcome.content, ensure_ascii=False).encode("utf-8"))
        if size <= self.max_content_bytes:
            return outcome
        self.refused += 1
        return ToolOutcome.failure(
            f"The result of {tool!r} is {size:,} bytes, above the {self.max_content_bytes:,} "
            "bytes a tool result may take in the session log, and it could not be spilled "
            "(it is not plain text, or the spill store failed). Ask for a smaller result.",
            name=RESULT_TOO_LARGE[0], code=RESULT_TOO_LARGE[1])


def kafka_spill_policy(settings: Settings) -> SpillPolicy:
    """The driver's policy: spill to ``<prefix>spill`` above ``DSH_SPILL_INLINE_BYTES``."""

    async def save(text: str) -> SpilledText:
        ref = await save_spill(settings, text)
        return SpilledText(ref.locator, ref.to_meta())

    return SpillPolicy(save, inline_bytes=settings.spill_inline_bytes,
                       max_record_bytes=settings.max_record_bytes)
