"""A local Apicurio Registry (in-memory storage), started with ``java -jar quarkus-run.jar``.

Apicurio 3.3 is built for Java 21, so its ``java`` is looked up separately from Kafka's (which
runs on 17): $JAVA_HOME, PATH, then /usr/lib/jvm. Ready when ``GET /apis/ccompat/v7/subjects``
answers; then the global compatibility is set explicitly to BACKWARD_TRANSITIVE, because unlike
Confluent's registry Apicurio sets no rule by default. Plain ``urllib``: two calls, no client.

With a :class:`SecureSetup` it serves HTTPS only (``quarkus.http.insecure-requests=disabled``)
with the run's server certificate, and HTTP basic auth against embedded users without an OIDC
server (``quarkus.oidc.tenant-enabled=false``): ``admin`` has role ``sr-admin`` (registers
schemas, sets rules), every other role's principal ``sr-readonly`` (reads schemas). The users'
passwords reach Quarkus through its environment (``QUARKUS_SECURITY_USERS_EMBEDDED_*``), never
through the command line.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Final

from dsh_dev.localstack.process import (
    ChildProcess,
    find_java,
    free_ports,
    port_is_free,
    wait_until,
)
from pipeline.adapters.secure.registry_auth import (
    EMBEDDED_ROLES_ENV,
    EMBEDDED_USERS_ENV,
    registry_role,
    secure_registry_properties,
)
from pipeline.adapters.secure.security import ROLES, SecureSetup
from pipeline.core.errors import ConfigError, RegistryError

READY_BUDGET_S: Final = 60.0
APICURIO_MIN_JAVA: Final = 21
CCOMPAT_PATH: Final = "/apis/ccompat/v7"
COMPATIBILITY: Final = "BACKWARD_TRANSITIVE"


class RegistryLocal:
    """One Apicurio Registry process on a free (or given) loopback port."""

    def __init__(self, jar: Path, workdir: Path | None = None, *, port: int | None = None,
                 heap_mb: int = 384, security: SecureSetup | None = None) -> None:
        if port is not None and not port_is_free(port):
            raise ConfigError(f"registry port {port} on 127.0.0.1 is already in use")
        self.jar = jar
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="dsh-registry-"))
        ports = free_ports(2)
        self.port = port if port is not None else ports[0]
        self.management_port = ports[1] if ports[1] != self.port else ports[0]
        self.heap_mb = heap_mb
        self.security = security
        self._proc: ChildProcess | None = None

    @property
    def base_url(self) -> str:
        scheme = "https" if self.security else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The Confluent-compatible (ccompat v7) base URL: what DSH_REGISTRY_URL takes."""
        return self.base_url + CCOMPAT_PATH

    @property
    def log_path(self) -> Path:
        return self.workdir / "registry.log"

    def __enter__(self) -> RegistryLocal:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, budget_s: float = READY_BUDGET_S) -> None:
        self.launch()
        self.wait_ready(budget_s)

    def launch(self) -> None:
        """Start the process without waiting for it."""
        java = find_java(APICURIO_MIN_JAVA)
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            java, "-Xms64m", f"-Xmx{self.heap_mb}m", "-XX:+UseSerialGC",
            *self._listener_options(), "-Dquarkus.http.host=127.0.0.1",
            # The management interface (health, metrics) is fixed on at build time and would
            # take 0.0.0.0:9000: give it its own free loopback port so instances can coexist.
            f"-Dquarkus.management.port={self.management_port}",
            "-Dquarkus.management.host=127.0.0.1",
            "-Dquarkus.http.access-log.enabled=false",
            f"-Dapicurio.storage.snapshot.location={self.workdir}",
            f"-Dapicurio.import.work-dir={self.workdir}",
            f"-Djava.io.tmpdir={self.workdir}",
            "-jar", str(self.jar),
        ]
        self._proc = ChildProcess("apicurio registry", argv, self.log_path, self.jar.parent,
                                  env=self._environment())

    def _listener_options(self) -> list[str]:
        if self.security is None:
            return [f"-Dquarkus.http.port={self.port}"]
        pki = self.security.pki
        properties = secure_registry_properties(str(pki.cert_file), str(pki.key_file),
                                                self.port)
        return [*(f"-D{name}={value}" for name, value in properties.items()),
                # A free plain port that nothing serves (insecure requests disabled).
                f"-Dquarkus.http.port={free_ports(1)[0]}"]

    def _environment(self) -> dict[str, str] | None:
        """The parent's environment plus the embedded users (secure only)."""
        if self.security is None:
            return None
        env = dict(os.environ)
        for role in ROLES:
            key = role.upper()
            env[f"{EMBEDDED_USERS_ENV}_{key}"] = self.security.password(role)
            env[f"{EMBEDDED_ROLES_ENV}_{key}"] = registry_role(role)
        return env

    def _open(self, request: urllib.request.Request | str, timeout: float) -> Any:
        """urlopen trusting the run's CA and sending the admin's basic auth when secure."""
        if self.security is None:
            return urllib.request.urlopen(request, timeout=timeout)
        if isinstance(request, str):
            request = urllib.request.Request(request)
        token = base64.b64encode(f"admin:{self.security.password('admin')}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
        context = ssl.create_default_context(cafile=str(self.security.pki.ca_file))
        return urllib.request.urlopen(request, timeout=timeout, context=context)

    def wait_ready(self, budget_s: float = READY_BUDGET_S) -> None:
        """Block until the ccompat API answers, then set the global compatibility."""
        if self._proc is None:
            raise RegistryError("the local registry was not launched")
        deadline = time.monotonic() + budget_s
        while not self._answers(self.url + "/subjects"):
            if not self._proc.alive():
                raise RegistryError(self._failure(f"exited with {self._proc.returncode}"))
            if not wait_until(deadline, 0.2):
                raise RegistryError(self._failure(f"not ready within {budget_s:.0f} s"))
        self._set_compatibility()

    def alive(self) -> bool:
        """Whether the launched process is still running (False before launch)."""
        return self._proc is not None and self._proc.alive()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()
            self._proc = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _set_compatibility(self) -> None:
        body = json.dumps({"compatibility": COMPATIBILITY}).encode()
        request = urllib.request.Request(
            self.url + "/config", data=body, method="PUT",
            headers={"Content-Type": "application/vnd.schemaregistry.v1+json"})
        try:
            with self._open(request, timeout=10) as response:
                answer = json.loads(response.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise RegistryError(f"setting global compatibility at {self.url}/config failed: "
                                f"{exc}") from None
        if answer.get("compatibility") != COMPATIBILITY:
            raise RegistryError(f"registry at {self.url} answered {answer!r} when setting "
                                f"compatibility {COMPATIBILITY}")

    def _failure(self, what: str) -> str:
        tail = self._proc.log_tail() if self._proc else ""
        return f"local registry at {self.url}: {what}; last lines of {self.log_path}:\n{tail}"


    def _answers(self, url: str) -> bool:
        try:
            with self._open(url, timeout=2) as response:
                return int(response.status) == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False
