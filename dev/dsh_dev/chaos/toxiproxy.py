"""Toxiproxy (Shopify/toxiproxy v2.12.0): a TCP proxy per broker, and network faults through it.

The server binary is installed by ``make toxiproxy`` (``go install
github.com/Shopify/toxiproxy/v2/cmd/server@v2.12.0``, pinned: ``@latest`` resolves to the
old v2.5.0) into ``<cache>/toxiproxy-2.12.0/server`` (the cache is ``$DSH_CACHE_DIR`` or
``.cache/``). It runs as a child process on a loopback port; :class:`Toxiproxy` drives its HTTP
API (``POST /proxies``, ``POST /proxies/{p}/toxics``, ``DELETE .../toxics/{t}``,
``POST /reset``) with the standard library, every call bounded by a timeout.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Final

from dsh_dev.localstack.artifacts import default_cache_dir
from dsh_dev.localstack.process import ChildProcess, free_ports, wait_until
from pipeline.core.errors import BrokerError, ConfigError

TOXIPROXY_VERSION: Final = "2.12.0"
API_TIMEOUT_S: Final = 5.0
READY_BUDGET_S: Final = 15.0


def toxiproxy_binary() -> Path:
    """Where ``make toxiproxy`` puts the server (it may not exist yet)."""
    return default_cache_dir() / f"toxiproxy-{TOXIPROXY_VERSION}" / "server"


class Toxiproxy:
    """The server process and its API. ``start()``, then ``proxy()`` per upstream."""

    def __init__(self, workdir: Path, binary: Path | None = None) -> None:
        self.binary = (binary or toxiproxy_binary()).resolve()
        self.workdir = workdir
        self.port = free_ports(1)[0]
        self.api = f"http://127.0.0.1:{self.port}"
        self._process: ChildProcess | None = None

    def start(self) -> None:
        if not self.binary.is_file():
            # make installs it into its own cache (the checkout's .cache/): outside make, the
            # command looks there only when DSH_CACHE_DIR says so
            raise ConfigError(f"no Toxiproxy server at {self.binary}: run `make chaos` (or "
                              f"`make toxiproxy`, then set DSH_CACHE_DIR to the checkout's "
                              f".cache/ as make does; it runs go install "
                              f".../toxiproxy/v2/cmd/server@v{TOXIPROXY_VERSION})")
        self._process = ChildProcess(
            "toxiproxy", [str(self.binary), "-host", "127.0.0.1", "-port", str(self.port)],
            self.workdir / "toxiproxy.log", self.workdir)
        deadline = time.monotonic() + READY_BUDGET_S
        while True:
            try:
                self._call("GET", "/version")
                return
            except BrokerError:
                if not self._process.alive() or not wait_until(deadline, 0.1):
                    raise BrokerError("Toxiproxy did not answer; last lines of its log:\n"
                                      + self._process.log_tail()) from None

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop(5.0)
            self._process = None

    def proxy(self, name: str, upstream_port: int) -> int:
        """A proxy ``name`` on a new loopback port forwarding to ``upstream_port``."""
        port = free_ports(1)[0]
        self._call("POST", "/proxies", {"name": name, "listen": f"127.0.0.1:{port}",
                                        "upstream": f"127.0.0.1:{upstream_port}",
                                        "enabled": True})
        return port

    def add_toxic(self, proxy: str, name: str, kind: str, attributes: dict[str, int], *,
                  stream: str = "downstream", toxicity: float = 1.0) -> None:
        self._call("POST", f"/proxies/{proxy}/toxics",
                   {"name": name, "type": kind, "stream": stream, "toxicity": toxicity,
                    "attributes": attributes})

    def remove_toxic(self, proxy: str, name: str) -> None:
        self._call("DELETE", f"/proxies/{proxy}/toxics/{name}")

    def reset(self) -> None:
        """Remove every toxic and enable every proxy."""
        self._call("POST", "/reset")

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.api + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=API_TIMEOUT_S) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:300]
            raise BrokerError(f"toxiproxy {method} {path}: HTTP {exc.code}: {detail}") from None
        except (OSError, urllib.error.URLError) as exc:
            raise BrokerError(f"toxiproxy {method} {path}: {exc}") from None
        return json.loads(raw) if raw.strip() else None
