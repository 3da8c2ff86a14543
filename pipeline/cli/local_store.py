"""The processors' local RocksDB store is trusted only after a clean stop.

faust writes a table value into RocksDB when the table is written, sends its changelog record
afterwards, and stores the changelog offset with a separate put once that record is
acknowledged. A kill -9 in between leaves the store ahead of the changelog: with the offset
behind the data, recovery rewrites those keys (harmless); with a value whose changelog record
was never acknowledged, that value would stay in the store for good, a table the changelog
does not hold (tests/services/processors/test_processors_rocksdb.py builds both states).

So a worker on ``rocksdb://`` removes a marker file from its data folder when it starts and
writes it back only when it stops cleanly (exit status 0). A data folder without the marker
was left by a crash: it is emptied before faust opens it, and the tables are restored from
their changelogs, as on ``memory://``. A clean restart keeps the store and reads only each
changelog's tail.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Final

CLEAN_STOP_MARKER: Final = "dsh-clean-stop"

log = logging.getLogger(__name__)


def run_with_trusted_store(store: str, data_dir: str, run: Callable[[], int]) -> int:
    """Run the worker (``run`` returns its exit status) keeping the rule above."""
    if not store.startswith("rocksdb://"):
        return run()
    folder = Path(data_dir)
    marker = folder / CLEAN_STOP_MARKER
    if folder.is_dir() and not marker.is_file() and any(folder.iterdir()):
        log.warning("the RocksDB store in %s was not closed cleanly (no %s): emptied, the "
                    "tables are restored from their changelogs", folder, CLEAN_STOP_MARKER)
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    code = run()
    if code == 0:
        marker.write_text("stopped cleanly\n", encoding="utf-8")
    return code
