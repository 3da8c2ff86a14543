"""``dsh-pipeline broker``: the local Kafka and schema registry in the foreground.

Resolves the Java artifacts if missing (Maven Central, cached in ``$DSH_CACHE_DIR``, by default
``~/.cache/dsh-pipeline``), starts a KRaft Kafka (one node, or three with ``--nodes 3``, also
spelled ``--cluster 3``) and Apicurio Registry, ensures the project's topics, then prints
exactly one line on stdout::

    ready bootstrap=127.0.0.1:9092 registry=http://127.0.0.1:8081/apis/ccompat/v7

With ``--secure`` (docs/security.md): a fresh CA and certificates in a run folder, Kafka on
SASL_SSL/SCRAM-SHA-512 with the StandardAuthorizer and one principal per role holding only its
ACLs, the registry on HTTPS with basic auth; the admin registers the schemas. The ready line
then also names the env files (``env=<run>/env/{role}.env``): ``set -a; . <file>`` gives a
command that role's settings. Passwords are only in those files, never printed.

Progress goes to stderr. Ctrl-C or SIGTERM stops both and exits 0. The default ports are the
ones the default settings point at (``DSH_BOOTSTRAP_SERVERS``, ``DSH_REGISTRY_URL``), so other
commands find the stack without configuration; ``--port 0`` picks free ports.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any, Final
from urllib.parse import urlsplit

from dsh_dev.localstack.artifacts import Artifacts, ensure_artifacts
from dsh_dev.localstack.stack import LocalStack
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.registry.client import RegistryClient
from pipeline.adapters.registry.outputs import register_output_schemas
from pipeline.adapters.secure.acls import acl_plan
from pipeline.adapters.secure.security import SecureSetup, read_env_file
from pipeline.cli.common import add_duration, add_logging_options, configure_logging
from pipeline.cli.registry_codecs import registry_codecs
from pipeline.core.errors import ConfigError
from pipeline.settings import Settings

WATCH_INTERVAL_S: Final = 0.5


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "broker", help="run a local Kafka and schema registry in the foreground",
        description="Run a local Apache Kafka (KRaft) and Apicurio Registry until Ctrl-C.")
    parser.add_argument("--nodes", "--cluster", dest="nodes", type=int, choices=(1, 3),
                        default=1, metavar="N",
                        help="Kafka nodes: 1 (default) or 3 (replication 3, min ISR 2)")
    parser.add_argument("--secure", action="store_true",
                        help="TLS + SASL/SCRAM-SHA-512 with per-role ACLs, registry on HTTPS "
                             "with basic auth (docs/security.md)")
    parser.add_argument("--run-dir", type=Path, default=None, metavar="DIR",
                        help="with --secure: where certificates and env files go (default: a "
                             "new temporary folder, removed at exit)")
    parser.add_argument("--port", type=int, default=None,
                        help="Kafka port (default: the port of DSH_BOOTSTRAP_SERVERS; 0: free)")
    parser.add_argument("--registry-port", type=int, default=None,
                        help="registry port (default: the port of DSH_REGISTRY_URL; 0: free)")
    add_duration(parser, "--ready-timeout", default=60.0,
                 help="how long each of Kafka and the registry may take to answer")
    parser.add_argument("--fetch-only", action="store_true",
                        help="only resolve the Java artifacts into the cache, then exit")
    parser.add_argument("--with-tools", action="store_true",
                        help="also resolve Kafka's perf tools (for bench/)")
    add_logging_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    configure_logging(args)
    artifacts = Artifacts.default()
    ensure_artifacts(artifacts, with_tools=args.with_tools, with_acl_tool=args.secure,
                     progress=_progress)
    if args.fetch_only:
        return 0
    first_server = settings.bootstrap_servers.split(",")[0]
    kafka_port = _port(args.port, first_server, "DSH_BOOTSTRAP_SERVERS")
    registry_port = _port(args.registry_port, settings.registry_url, "DSH_REGISTRY_URL")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="dsh-secure-"))
    security = SecureSetup.create(run_dir) if args.secure else None
    stack = LocalStack(artifacts, nodes=args.nodes, kafka_port=kafka_port,
                       registry_port=registry_port, security=security,
                       acl_rules=acl_plan(settings))
    previous = signal.signal(signal.SIGTERM, _interrupt)
    ready = False
    try:
        _progress(f"starting Kafka ({args.nodes} node(s)) and Apicurio Registry"
                  f"{' (secure)' if security else ''} ...")
        stack.start(budget_s=args.ready_timeout)
        _progress(f"both answered after {stack.started_s:.1f} s; ensuring topics ...")
        prepare_stack(stack, settings, args.nodes)
        print(ready_line(stack), flush=True)
        ready = True
        return _watch(stack)
    except KeyboardInterrupt:
        return 0 if ready else 130
    finally:
        # A second Ctrl-C or SIGTERM must not cut the shutdown short.
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _progress("stopping ...")
        stack.stop()
        if security is not None and args.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        _progress("stopped")


def role_settings(stack: LocalStack, settings: Settings, nodes: int,
                  role: str = "admin") -> Settings:
    """``settings`` pointed at the stack, as ``role``'s principal when it is secure."""
    local = replace(settings, bootstrap_servers=stack.bootstrap,
                    registry_url=stack.registry_url, replication_factor=nodes)
    if stack.security is None:
        return local
    env = read_env_file(stack.security.env_file(role))
    return Settings.from_env({**local.to_env(), **env})


def prepare_stack(stack: LocalStack, settings: Settings, nodes: int) -> None:
    """Ensure the topics; on a secure stack also register the schemas (as the admin: the
    services' principals may only read them)."""
    admin = role_settings(stack, settings, nodes)
    report = asyncio.run(ensure_topics(admin))
    _progress(f"topics: {len(report.created)} created, {len(report.existing)} existing "
              f"(prefix {admin.topic_prefix!r}, {admin.partitions} partitions)")
    if stack.security is not None:
        with RegistryClient.from_settings(admin) as client:
            registry_codecs(admin, client)
            register_output_schemas(client, admin.topics)
        _progress(f"schemas registered; ACLs created by {stack.acl_runs} kafka-acls runs")


def ready_line(stack: LocalStack) -> str:
    """The one ready line (with the env files' pattern when secure)."""
    line = f"ready bootstrap={stack.bootstrap} registry={stack.registry_url}"
    if stack.security is not None:
        line += f" env={stack.security.env_dir}/{{role}}.env"
    return line


def _watch(stack: LocalStack) -> int:
    """Sleep until interrupted; 1 if a process dies on its own meanwhile."""
    while True:
        time.sleep(WATCH_INTERVAL_S)
        for name, log in stack.dead_processes():
            _progress(f"error: {name} exited unexpectedly; see {log}")
            return 1


def _port(given: int | None, address: str, variable: str) -> int | None:
    """The port to use: the flag, else the one in the setting's address; None = any free."""
    if given is not None:
        return given or None
    try:
        port = urlsplit(address if "//" in address else f"//{address}").port
    except ValueError:
        raise ConfigError(f"{variable}={address!r} has no valid port") from None
    return port


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
