"""Child processes of the benchmarks: their CPU time, and stopping them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(proc: subprocess.Popen[str] | subprocess.Popen[bytes], wait_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL when it has not exited within ``wait_s``."""
    proc.terminate()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
