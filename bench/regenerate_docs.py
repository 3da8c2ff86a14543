"""Rewrites the generated blocks of the docs from the code: the settings reference in
docs/configuration.md and deploy/README.md, and the exit-code table of docs/cli.md
(``make docs``; tests/system/test_docs.py fails while they differ)."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.cli import cmd_config
from pipeline.cli.common import exit_code_table
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def replace_block(path: Path, begin: str, body: str) -> bool:
    text = path.read_text()
    start = re.search(re.escape(begin) + r"[^\n]*-->\n", text)
    if start is None:
        raise SystemExit(f"{path}: no {begin} marker")
    end = text.index("<!-- END", start.end())
    new = text[:start.end()] + body + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


def main() -> None:
    settings = cmd_config.render_markdown(cmd_config.setting_rows(Settings()))
    changed = [str(p.relative_to(ROOT)) for p, begin, body in (
        (ROOT / "docs/configuration.md", "<!-- BEGIN config reference", settings),
        (ROOT / "deploy/README.md", "<!-- BEGIN config reference", settings),
        (ROOT / "docs/cli.md", "<!-- BEGIN exit codes", exit_code_table()),
    ) if replace_block(p, begin, body)]
    print("rewritten: " + (", ".join(changed) or "nothing (already current)"))


if __name__ == "__main__":
    main()
