"""The mcpServers file, secrets in it, and MCP results as dsh tool results (no server)."""

from __future__ import annotations

import base64
import json
import pathlib

import pytest

from pipeline.adapters.mcp import load_mcp_config, outcome_of, parse_mcp_config
from pipeline.core.errors import ConfigError, ToolServerError
from pipeline.settings import MASK, Settings

SECRET = "sk-live-0123456789abcdef"


def test_stdio_and_http_servers_are_read_and_secrets_never_printed(tmp_path: pathlib.Path
                                                                   ) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "server"], "env": {"TOKEN": SECRET}},
        "search": {"url": "https://mcp.example.com/mcp",
                   "headers": {"Authorization": f"Bearer {SECRET}"}, "parallelSafe": True},
        "off": {"command": "x", "disabled": True}}}))
    files, search = load_mcp_config(str(path))
    assert (files.name, files.transport, files.args) == ("files", "stdio", ("-y", "server"))
    assert files.env["TOKEN"].reveal() == SECRET
    assert (search.transport, search.parallel_safe) == ("streamable-http", True)
    for shown in (repr(files), str(files), repr(search), json.dumps(search.describe())):
        assert SECRET not in shown
    assert search.scrub(f"401 for Bearer {SECRET}") == f"401 for {MASK}"
    assert files.scrub(f"token={SECRET}!") == f"token={MASK}!"


@pytest.mark.parametrize(("document", "problem"), [
    ({}, "expected an object"),
    ({"mcpServers": {"bad name": {"command": "x"}}}, "must match"),
    ({"mcpServers": {"a" * 33: {"command": "x"}}}, "must match"),
    ({"mcpServers": {"s": {"command": "x", "url": "http://h"}}}, "exactly one of"),
    ({"mcpServers": {"s": {}}}, "exactly one of"),
    ({"mcpServers": {"s": {"command": "x", "headers": {}}}}, "do not go with command"),
    ({"mcpServers": {"s": {"url": "ftp://h"}}}, "http:// or https://"),
    ({"mcpServers": {"s": {"command": "x", "env": {"K": 1}}}}, "must be strings"),
    ({"mcpServers": {"s": {"command": "x", "timeoutMs": 5}}}, "unknown keys"),
])
def test_a_bad_config_is_a_config_error_that_names_the_problem(document: object,
                                                               problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_mcp_config(document)


def test_an_unreadable_or_non_json_file_is_a_config_error_without_its_content(
        tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_mcp_config(str(tmp_path / "missing.json"))
    path = tmp_path / "mcp.json"
    path.write_text('{"mcpServers": {"s": {"env": {"K": "' + SECRET + '"}')
    with pytest.raises(ConfigError, match="not JSON") as caught:
        load_mcp_config(str(path))
    assert SECRET not in str(caught.value)


def test_tool_timeout_and_mcp_config_are_settings() -> None:
    settings = Settings.from_env({"DSH_TOOL_TIMEOUT": "2.5", "DSH_MCP_CONFIG": "/etc/mcp.json"})
    assert (settings.tool_timeout, settings.mcp_config) == (2.5, "/etc/mcp.json")
    assert Settings().tool_timeout == 60.0
    for bad in ("0", "soon"):
        with pytest.raises(ConfigError, match="DSH_TOOL_TIMEOUT"):
            Settings.from_env({"DSH_TOOL_TIMEOUT": bad})


def test_content_blocks_become_one_text_binary_as_a_note() -> None:
    png = base64.b64encode(b"\x89PNG" + b"\0" * 1020).decode()
    outcome = outcome_of({"content": [
        {"type": "text", "text": "before"},
        {"type": "image", "mimeType": "image/png", "data": png},
        {"type": "audio", "mimeType": "audio/wav", "data": "AAAA"},
        {"type": "resource_link", "name": "readme", "uri": "file:///r.md"},
        {"type": "resource", "resource": {"uri": "file:///a.txt", "text": "inside"}},
        {"type": "resource", "resource": {"uri": "file:///b.bin", "blob": "AAAAAA==",
                                          "mimeType": "application/zip"}},
        {"type": "video"}]}, server="srv", raw_name="t")
    assert not outcome.is_error and len(outcome.content) == 1
    assert outcome.content[0]["text"].split("\n") == [
        "before",
        "[image: image/png, 1,024 bytes; not shown to the model]",
        "[audio: audio/wav, 3 bytes; not shown to the model]",
        "Resource link: readme (file:///r.md)",
        "Resource file:///a.txt:", "inside",
        "[resource file:///b.bin: application/zip, 4 bytes; not shown to the model]",
        "[unsupported MCP content type: video]"]
    assert png not in json.dumps(outcome.content)
    assert outcome.meta == {"mcp": {"server": "srv", "tool": "t"}}


def test_is_error_is_an_error_result_and_structured_content_is_shown_once() -> None:
    failed = outcome_of({"content": [{"type": "text", "text": "no such file"}], "isError": True},
                        server="fs", raw_name="read")
    assert failed.is_error and failed.error == {"name": "McpToolError", "code": "MCP_TOOL_ERROR"}
    assert failed.content[0]["text"] == "no such file"
    only_structured = outcome_of({"content": [], "structuredContent": {"t": 21}},
                                 server="s", raw_name="w")
    assert only_structured.content[0]["text"] == '{"t": 21}'
    both = outcome_of({"content": [{"type": "text", "text": '{"t": 21}'}],
                       "structuredContent": {"t": 21}}, server="s", raw_name="w")
    assert both.content[0]["text"] == '{"t": 21}'
    empty = outcome_of({"content": []}, server="s", raw_name="w")
    assert empty.content[0]["text"] == "(w returned no model-visible content)"


def test_tool_server_errors_carry_server_and_code() -> None:
    error = ToolServerError("MCP server 'x': down", server="x", code="UNAVAILABLE")
    assert (error.server, error.code) == ("x", "UNAVAILABLE")


def test_driver_script_tool_arguments_are_checked() -> None:
    import argparse

    from pipeline.cli.cmd_driver import mcp_tools_from, script_from_args

    def args(**given: object) -> argparse.Namespace:
        return argparse.Namespace(**{"script": "echo", "script_tool": None,
                                     "script_arguments": "{}", **given})

    assert script_from_args(args()) is not None
    assert script_from_args(args(script_tool="mcp__files__read_text_file",
                                 script_arguments='{"path": "/a"}')) is not None
    for bad, problem in ((args(script_arguments='{"a": 1}'), "only goes with --script-tool"),
                         (args(script_tool="t", script_arguments="{"), "is not JSON"),
                         (args(script_tool="t", script_arguments="[1]"), "a JSON object")):
        with pytest.raises(ConfigError, match=problem):
            script_from_args(bad)
    assert mcp_tools_from("", Settings()) is None
