"""Child Java processes that never outlive the Python process that started them.

Each child runs in its own process group (so a stop reaches everything it spawned), with its
output in a log file. Three guards make sure no child is left behind: an explicit ``stop()``
(SIGTERM, then SIGKILL after a timeout), an ``atexit`` hook stopping every child still running,
and on Linux ``PR_SET_PDEATHSIG`` so the kernel kills the child even when Python itself is
killed with SIGKILL. (The death signal follows the thread that started the child: start
children from a long-lived thread, as the CLI and the test fixtures do.)
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from pipeline.core.errors import ConfigError

STOP_TIMEOUT_S: Final = 15.0
PR_SET_PDEATHSIG: Final = 1
LOG_TAIL_LINES: Final = 40
_STACK_FRAME: Final = re.compile(r"\s+(at |\.\.\. \d+ more)")

_live: set[ChildProcess] = set()
_live_lock = threading.Lock()


class ChildProcess:
    """One started child process with its log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, cwd: Path, *,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            try:
                self._popen = subprocess.Popen(
                    list(argv), cwd=cwd, env=None if env is None else dict(env),
                    stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
            except OSError as exc:
                raise ConfigError(f"cannot start {name} ({argv[0]}): {exc}") from None
        with _live_lock:
            _live.add(self)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def kill9(self) -> None:
        """SIGKILL the whole process group at once (failure tests use this)."""
        self._signal_group(signal.SIGKILL)
        self._popen.wait()
        self._forget()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM the process group, SIGKILL it if still alive after ``timeout_s``."""
        self.terminate()
        return self.wait_stopped(timeout_s)

    def terminate(self) -> None:
        """Ask the process group to stop (SIGTERM) without waiting: stop several at once."""
        if self.alive():
            self._signal_group(signal.SIGTERM)

    def wait_stopped(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Wait for the exit after :meth:`terminate`; SIGKILL the group after ``timeout_s``."""
        try:
            self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self._popen.wait()
        # The leader may be gone while children of its group live on.
        self._signal_group(signal.SIGKILL)
        self._forget()
        return self._popen.returncode

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the log without Java stack frames, for error messages
        (the frames would push the "Caused by" lines that say what went wrong out of view)."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return f"(no log at {self.log_path})"
        kept = [line for line in text.splitlines() if not _STACK_FRAME.match(line)]
        return "\n".join(kept[-lines:])

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, sig)

    def _forget(self) -> None:
        with _live_lock:
            _live.discard(self)


# Resolved once in the parent: the child, between fork and exec, must not dlopen anything.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


@atexit.register
def stop_all_children() -> None:
    """Stop every child still running (registered with atexit)."""
    with _live_lock:
        children = list(_live)
    for child in children:
        child.stop(timeout_s=5.0)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (held together while choosing)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_is_free(port: int) -> bool:
    """Whether a server may listen on 127.0.0.1:port as Kafka's and the registry's listeners
    do: with SO_REUSEADDR, so connections of a stopped server left in TIME_WAIT do not count,
    while a port another process listens on does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
        except OSError:
            return False
    return True


def java_major(java: str) -> int | None:
    """The major version of the ``java`` executable, or None if it does not run."""
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', done.stderr)
    if match is None:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def find_java(min_major: int, override: str = "") -> str:
    """A ``java`` of at least ``min_major``: ``override``, then $JAVA_HOME, PATH, /usr/lib/jvm."""
    candidates = [override] if override else []
    java_home = os.environ.get("JAVA_HOME", "")
    if java_home:
        candidates.append(str(Path(java_home) / "bin" / "java"))
    on_path = shutil.which("java")
    if on_path:
        candidates.append(on_path)
    candidates += sorted((str(p) for p in Path("/usr/lib/jvm").glob("*/bin/java")), reverse=True)
    seen: list[str] = []
    for java in candidates:
        major = java_major(java)
        seen.append(f"{java} ({major or 'not runnable'})")
        if major is not None and major >= min_major:
            return java
        if override and java == override:
            break
    raise ConfigError(f"no Java {min_major}+ found; tried: {', '.join(seen) or 'nothing'}. "
                      "Install one, or point JAVA_HOME at it")


def wait_until(deadline: float, step_s: float = 0.2) -> bool:
    """Sleep one step; False once ``deadline`` (monotonic) has passed."""
    if time.monotonic() >= deadline:
        return False
    time.sleep(step_s)
    return True
