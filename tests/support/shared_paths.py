"""Where the shared reference material lives: ``shared/`` beside the checkout (as CI lays it
out), or ``$DSH_SHARED_DIR``."""

from __future__ import annotations

import os
from pathlib import Path

SHARED_DIR = Path(os.environ.get("DSH_SHARED_DIR")
                  or Path(__file__).resolve().parents[3] / "shared")
