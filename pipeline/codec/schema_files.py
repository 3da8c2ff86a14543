"""Where the Avro schema files (``schemas/`` at the repository's top) are read from.

A built wheel carries them as package data in ``pipeline/schemas/`` (setup.py copies the
repository's ``schemas/`` there at build time); an editable install or a checkout on
``PYTHONPATH`` has no such folder and reads the repository's ``schemas/`` beside the package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

_PACKAGE: Final = Path(__file__).resolve().parents[1]
PACKAGED_SCHEMA_DIR: Final = _PACKAGE / "schemas"
SOURCE_SCHEMA_DIR: Final = _PACKAGE.parent / "schemas"


def schema_dir() -> Path:
    """The folder of today's schemas (``history/`` inside it holds the earlier versions)."""
    return PACKAGED_SCHEMA_DIR if PACKAGED_SCHEMA_DIR.is_dir() else SOURCE_SCHEMA_DIR
