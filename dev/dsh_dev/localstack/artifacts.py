"""The local stack's Java artifacts, resolved from Maven Central into an ignored cache folder.

Folders under the cache (:func:`default_cache_dir`: ``$DSH_CACHE_DIR``, else
``$XDG_CACHE_HOME/dsh-pipeline`` or ``~/.cache/dsh-pipeline``; ``make`` sets ``DSH_CACHE_DIR`` to
the checkout's ``.cache/``):

- ``kafka-<v>/lib``: Apache Kafka's runtime classpath plus the log4j2 SLF4J binding;
- ``apicurio-registry-<v>/``: the unpacked Apicurio Registry Quarkus app (``quarkus-run.jar``);
- ``kafka-tools-<v>/lib``: Kafka's perf tools for ``bench/``, only when asked for, and kept off
  the broker's classpath (it pulls in connect-runtime);
- ``kafka-acl-tool-<v>/``: the ``kafka-tools`` jar alone, for ``kafka-acls``
  (``org.apache.kafka.tools.AclCommand``, in the tools jar since Kafka 4.0), which runs on
  the broker's classpath plus this jar; fetched for the secure stack.

Each folder is filled in a staging folder and renamed into place, then marked complete by a
marker file: a folder with its marker is never resolved again, a folder without one is redone.
The Maven plugin is called by its full coordinates because Maven 3.8's default is too old.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from pipeline.core.errors import ConfigError, TransportError

KAFKA_VERSION: Final = "4.4.0"
APICURIO_VERSION: Final = "3.3.3"
DEPENDENCY_PLUGIN: Final = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
MARKER: Final = ".complete"
MAVEN_TAIL_LINES: Final = 30

Progress = Callable[[str], None]

# The local stack's Maven POMs and configs: package data of this package (``files/``).
DEPLOY_DIR: Final = Path(__file__).resolve().with_name("files")
CACHE_DIR_ENV: Final = "DSH_CACHE_DIR"


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where downloaded and built tools are cached (the Kafka and registry artifacts,
    Toxiproxy, chaos runs): ``$DSH_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsh-pipeline``, else
    ``~/.cache/dsh-pipeline``. ``make`` sets ``DSH_CACHE_DIR`` to the checkout's ``.cache/``."""
    source = os.environ if env is None else env
    configured = source.get(CACHE_DIR_ENV, "").strip()
    if configured:
        return Path(configured).expanduser().resolve()
    xdg = source.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return (base / "dsh-pipeline").resolve()


@dataclass(frozen=True, slots=True)
class Artifacts:
    """Where the resolved artifacts live (the folders may not exist yet)."""

    cache_dir: Path

    @classmethod
    def default(cls) -> Artifacts:
        return cls(default_cache_dir())

    @property
    def kafka_dir(self) -> Path:
        return self.cache_dir / f"kafka-{KAFKA_VERSION}"

    @property
    def kafka_lib(self) -> Path:
        return self.kafka_dir / "lib"

    @property
    def apicurio_dir(self) -> Path:
        return self.cache_dir / f"apicurio-registry-{APICURIO_VERSION}"

    @property
    def apicurio_jar(self) -> Path:
        return self.apicurio_dir / "quarkus-run.jar"

    @property
    def tools_dir(self) -> Path:
        return self.cache_dir / f"kafka-tools-{KAFKA_VERSION}"

    @property
    def tools_lib(self) -> Path:
        return self.tools_dir / "lib"

    @property
    def acl_tool_dir(self) -> Path:
        return self.cache_dir / f"kafka-acl-tool-{KAFKA_VERSION}"

    def acl_tool_ready(self) -> bool:
        return (self.acl_tool_dir / MARKER).is_file()

    def require_acl_tool(self) -> Path:
        """The folder holding the ``kafka-tools`` jar; :class:`ConfigError` if missing."""
        if not self.acl_tool_ready():
            raise ConfigError(_missing("Kafka's ACL tool", self.acl_tool_dir))
        return self.acl_tool_dir

    def kafka_ready(self) -> bool:
        return (self.kafka_dir / MARKER).is_file()

    def apicurio_ready(self) -> bool:
        return (self.apicurio_dir / MARKER).is_file()

    def tools_ready(self) -> bool:
        return (self.tools_dir / MARKER).is_file()

    def require_kafka(self) -> Path:
        """The Kafka lib folder; :class:`ConfigError` saying how to get it if missing."""
        if not self.kafka_ready():
            raise ConfigError(_missing("Kafka", self.kafka_dir))
        return self.kafka_lib

    def require_apicurio(self) -> Path:
        """The Apicurio ``quarkus-run.jar``; :class:`ConfigError` if missing."""
        if not self.apicurio_ready():
            raise ConfigError(_missing("Apicurio Registry", self.apicurio_dir))
        return self.apicurio_jar


def _missing(what: str, folder: Path) -> str:
    return (f"{what} artifacts are not in {folder}: run `make setup` "
            "(or `dsh-pipeline broker --fetch-only`) to resolve them from Maven Central")


def ensure_artifacts(artifacts: Artifacts, *, with_tools: bool = False,
                     with_acl_tool: bool = False, progress: Progress = print) -> None:
    """Resolve whatever is missing; print progress. Idempotent: cached folders are skipped."""
    steps: list[tuple[str, Callable[[], bool], Path, Callable[[Path, Progress], None]]] = [
        (f"Kafka {KAFKA_VERSION}", artifacts.kafka_ready, artifacts.kafka_dir, _fetch_kafka),
        (f"Apicurio Registry {APICURIO_VERSION}", artifacts.apicurio_ready,
         artifacts.apicurio_dir, _fetch_apicurio),
    ]
    if with_acl_tool:
        steps.append((f"Kafka ACL tool {KAFKA_VERSION}", artifacts.acl_tool_ready,
                      artifacts.acl_tool_dir, _fetch_acl_tool))
    if with_tools:
        steps.append((f"Kafka tools {KAFKA_VERSION}", artifacts.tools_ready,
                      artifacts.tools_dir, _fetch_tools))
    for label, ready, folder, fetch in steps:
        if ready():
            progress(f"{label}: cached in {folder}")
            continue
        progress(f"{label}: resolving from Maven Central into {folder} ...")
        started = time.monotonic()
        _fill_atomically(folder, functools.partial(_call_fetch, fetch, progress))
        progress(f"{label}: done in {time.monotonic() - started:.1f} s")


def _call_fetch(fetch: Callable[[Path, Progress], None], progress: Progress,
                staging: Path) -> None:
    fetch(staging, progress)


def _fill_atomically(folder: Path, fill: Callable[[Path], None]) -> None:
    """Fill a staging folder, then move it to ``folder`` and write the marker."""
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    fill(staging)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    (folder / MARKER).write_text(f"resolved {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")


def _fetch_kafka(staging: Path, progress: Progress) -> None:
    pom = DEPLOY_DIR / "pom.xml"
    tree = _maven(["-f", str(pom), f"{DEPENDENCY_PLUGIN}:tree"], "read Kafka's dependency tree")
    log4j = _log4j_core_version(tree)
    progress(f"  log4j-core {log4j} in Kafka's tree: adding log4j-slf4j-impl {log4j}")
    _maven(["-f", str(pom), f"{DEPENDENCY_PLUGIN}:copy-dependencies", "-DincludeScope=runtime",
            f"-Dlog4j.version={log4j}", f"-DoutputDirectory={staging / 'lib'}"],
           "copy Kafka's runtime dependencies")
    if not list((staging / "lib").glob(f"kafka_2.13-{KAFKA_VERSION}.jar")):
        raise TransportError(f"Maven finished but kafka_2.13-{KAFKA_VERSION}.jar is missing "
                             f"from {staging / 'lib'}")


def _log4j_core_version(tree_output: str) -> str:
    match = re.search(r"org\.apache\.logging\.log4j:log4j-core:jar:([\w.\-]+):", tree_output)
    if match is None:
        raise TransportError("log4j-core is not in Kafka's dependency tree: cannot pick the "
                             "version of the log4j2 SLF4J binding")
    return match.group(1)


def _fetch_apicurio(staging: Path, progress: Progress) -> None:
    artifact = f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:tar.gz:all"
    # Always unpack: the plugin skips an artifact whose marker file (left in
    # files/target/ by an earlier run) exists, which would leave staging empty.
    _maven([f"{DEPENDENCY_PLUGIN}:unpack", f"-Dartifact={artifact}",
            f"-DoutputDirectory={staging}", "-Dmdep.overWriteReleases=true"],
           "unpack Apicurio Registry")
    if not (staging / "quarkus-run.jar").is_file():
        raise TransportError(f"{artifact} unpacked without quarkus-run.jar in {staging}")


def _fetch_tools(staging: Path, progress: Progress) -> None:
    _maven(["-f", str(DEPLOY_DIR / "kafka-tools.pom.xml"),
            f"{DEPENDENCY_PLUGIN}:copy-dependencies", "-DincludeScope=runtime",
            f"-DoutputDirectory={staging / 'lib'}"], "copy Kafka tools' runtime dependencies")


def _fetch_acl_tool(staging: Path, progress: Progress) -> None:
    artifact = f"org.apache.kafka:kafka-tools:{KAFKA_VERSION}"
    _maven([f"{DEPENDENCY_PLUGIN}:copy", f"-Dartifact={artifact}",
            f"-DoutputDirectory={staging}", "-Dmdep.overWriteReleases=true"],
           "copy Kafka's tools jar")
    if not (staging / f"kafka-tools-{KAFKA_VERSION}.jar").is_file():
        raise TransportError(f"Maven finished but kafka-tools-{KAFKA_VERSION}.jar is missing "
                             f"from {staging}")


def _maven(args: list[str], what: str) -> str:
    """Run Maven in batch mode; return its output, or raise with its last lines."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ConfigError("Maven (`mvn`) is not on PATH: install Maven 3.8+ to resolve the "
                          "local Kafka and registry")
    try:
        done = subprocess.run([mvn, "-B", "--no-transfer-progress", *args],
                              capture_output=True, text=True, cwd=DEPLOY_DIR, check=False)
    except OSError as exc:
        raise ConfigError(f"cannot run {mvn}: {exc}") from None
    output = done.stdout + done.stderr
    if done.returncode != 0:
        tail = "\n".join(output.splitlines()[-MAVEN_TAIL_LINES:])
        raise TransportError(f"Maven failed to {what} (exit {done.returncode}); "
                             f"its last lines:\n{tail}")
    return output
