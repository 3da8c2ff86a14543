"""dsh's model-facing names for MCP tools: ``mcp__{server}__{tool}``, normalized.

A copy of ``publicToolName`` in dsh's ``packages/mcp/mcp-client/src/tools.ts``, so that a
session this driver runs names its MCP tools exactly as dsh would: the clean case is the
joined name verbatim; when a character outside ``[A-Za-z0-9_-]`` had to become ``_``, or the
name is longer than the 64 characters a function name may have, the first 51 characters of
the normalized name, ``_`` and the first 12 hex digits of the SHA-256 of
``server + NUL + tool`` (UTF-8). The hash keeps distinct tools apart when their
normalized names collide (``admin.reset`` and ``admin_reset``).

JavaScript details kept on purpose: dsh's regex replaces each UTF-16 code unit, so a
character outside the Basic Multilingual Plane becomes two ``_``; Node encodes a lone
surrogate as U+FFFD before hashing.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

MAX_PUBLIC_NAME_LENGTH: Final = 64
HASH_LENGTH: Final = 12
PREFIX: Final = "mcp__"
_VALID_CHAR: Final = re.compile(r"[A-Za-z0-9_-]")
_LONE_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def public_tool_name(server: str, raw_name: str) -> str:
    """The name the model sees for ``raw_name`` of the server configured as ``server``."""
    joined = f"{PREFIX}{server}__{raw_name}"
    normalized = "".join(c if _VALID_CHAR.fullmatch(c) else "_" * _utf16_units(c)
                         for c in joined)
    if normalized == joined and len(normalized) <= MAX_PUBLIC_NAME_LENGTH:
        return normalized
    identity = _LONE_SURROGATE.sub("\ufffd", f"{server}\0{raw_name}").encode("utf-8")
    digest = hashlib.sha256(identity).hexdigest()[:HASH_LENGTH]
    return f"{normalized[:MAX_PUBLIC_NAME_LENGTH - HASH_LENGTH - 1]}_{digest}"


def _utf16_units(char: str) -> int:
    return 2 if ord(char) > 0xFFFF else 1
