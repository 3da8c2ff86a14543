"""An MCP ``tools/call`` result as a dsh tool result (:class:`ToolOutcome`).

As dsh's MCP client plugin renders one (``projectContent`` in its ``tools.ts``): the content
blocks become one text, blocks joined with newlines:

- ``text``: as it is;
- ``image`` and ``audio``: a note with the media type and decoded size
  (``[image: image/png, 1,024 bytes; not shown to the model]``), never the base64 data: a
  pipeline session log is text for the model and for people, and dsh itself shows a model
  an image only after storing it as an attachment, which this pipeline has no store for;
- ``resource_link``: ``Resource link: NAME (URI)``;
- ``resource`` (embedded): its text with its URI when it is text; a note like an image's
  when it is a blob (dsh shows a placeholder for both; the text is worth having);
- ``structuredContent``: as JSON text when no content block has text (servers are asked to
  repeat it as text, and most do; then it is not shown twice);
- nothing at all: ``(TOOL returned no model-visible content)``.

``isError: true`` makes the result an error result (``McpToolError``/``MCP_TOOL_ERROR``) with
the same text, which the model sees. Large texts are then bounded by the driver's spill
policy like any tool's, since the result is plain text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from pipeline.core.turn_effects import ToolOutcome

MCP_TOOL_ERROR: Final = ("McpToolError", "MCP_TOOL_ERROR")


def outcome_of(result: Mapping[str, Any], *, server: str, raw_name: str) -> ToolOutcome:
    """The tool result for a ``tools/call`` answer (a JSON object, as on the wire)."""
    content = result.get("content")
    blocks = content if isinstance(content, list) else []
    texts = [_block_text(block) for block in blocks]
    has_text = any(isinstance(b, Mapping) and b.get("type") == "text" for b in blocks)
    structured = result.get("structuredContent")
    if structured is not None and not has_text:
        texts.append(json.dumps(structured, ensure_ascii=False))
    text = "\n".join(texts) if texts else f"({raw_name} returned no model-visible content)"
    meta = {"mcp": {"server": server, "tool": raw_name}}
    if result.get("isError") is True:
        return ToolOutcome(({"type": "text", "text": text},), True,
                           {"name": MCP_TOOL_ERROR[0], "code": MCP_TOOL_ERROR[1]}, meta=meta)
    return ToolOutcome(({"type": "text", "text": text},), meta=meta)


def _block_text(block: Any) -> str:
    if not isinstance(block, Mapping):
        return "[unsupported MCP content block: expected an object]"
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind in ("image", "audio"):
        return binary_note(str(kind), block.get("mimeType"), block.get("data"))
    if kind == "resource_link":
        if block.get("name") is None or block.get("uri") is None:
            return "[resource link unavailable: the MCP block is missing its name or URI]"
        return f"Resource link: {block['name']} ({block['uri']})"
    if kind == "resource":
        return _resource_text(block.get("resource"))
    return f"[unsupported MCP content type: {kind}]"


def _resource_text(resource: Any) -> str:
    if not isinstance(resource, Mapping):
        return "[embedded resource unavailable: the MCP block has no resource]"
    uri = resource.get("uri", "?")
    if isinstance(resource.get("text"), str):
        return f"Resource {uri}:\n{resource['text']}"
    return binary_note(f"resource {uri}", resource.get("mimeType"), resource.get("blob"))


def binary_note(what: str, mime_type: Any, data: Any) -> str:
    """A note standing for base64 content: kind, media type, decoded size; never the data."""
    media = mime_type if isinstance(mime_type, str) and mime_type else "unknown media type"
    size = _decoded_size(data) if isinstance(data, str) else 0
    return f"[{what}: {media}, {size:,} bytes; not shown to the model]"


def _decoded_size(data: str) -> int:
    """Bytes that base64 text decodes to, without decoding it."""
    stripped = data.strip()
    return max(0, len(stripped) * 3 // 4 - (len(stripped) - len(stripped.rstrip("="))))
