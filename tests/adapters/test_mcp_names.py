"""MCP tools' public names are dsh's, character for character (``publicToolName`` in dsh's
packages/mcp/mcp-client/src/tools.ts).

The expected names were computed by running dsh's function itself under Node (v20) on these
inputs; the first four cases are the ones of dsh's own tests
(packages/mcp/mcp-client/tests/mcp-client.spec.ts: clean names, ``admin.reset``, an 80-char
name, ``admin.reset`` vs ``admin_reset``).
"""

from __future__ import annotations

import pytest

from pipeline.adapters.mcp.names import MAX_PUBLIC_NAME_LENGTH, public_tool_name

CASES = [
    ("github", "create_issue", "mcp__github__create_issue"),
    ("everything", "get-sum", "mcp__everything__get-sum"),
    ("srv", "admin.reset", "mcp__srv__admin_reset_3b185f786768"),
    ("srv", "admin_reset", "mcp__srv__admin_reset"),
    ("srv", "a" * 80, "mcp__srv__" + "a" * 41 + "_3b75b5cc78d8"),
    ("srv", "a" * 54, "mcp__srv__" + "a" * 54),  # exactly 64: kept verbatim
    ("fs", "read file", "mcp__fs__read_file_fe5680de441b"),
    ("fs", "ünïcode", "mcp__fs___n_code_9d4fa967a627"),
    ("fs", "emoji\U0001F600tool", "mcp__fs__emoji__tool_273f71c48729"),  # 2 UTF-16 units
    ("my.server", "tool", "mcp__my_server__tool_ddd9af89221e"),
    ("srv", "lone\ud800x", "mcp__srv__lone_x_bb9214c115b6"),  # hashed as U+FFFD, as Node does
    ("srv", "", "mcp__srv__"),
]


@pytest.mark.parametrize(("server", "raw", "expected"), CASES)
def test_public_names_are_dshs(server: str, raw: str, expected: str) -> None:
    name = public_tool_name(server, raw)
    assert name == expected
    assert len(name) <= MAX_PUBLIC_NAME_LENGTH


def test_names_that_normalize_alike_stay_apart_and_are_stable() -> None:
    assert public_tool_name("srv", "admin.reset") != public_tool_name("srv", "admin_reset")
    assert public_tool_name("srv", "a" * 80) == public_tool_name("srv", "a" * 80)
    assert public_tool_name("srv", "a" * 55) != public_tool_name("srv", "a" * 56)
