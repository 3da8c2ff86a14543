"""The secure compose stack's certificates and credentials, written by ``dsh-pipeline certs``.

The same generator as ``broker --secure`` (:class:`SecureSetup`: CA, server certificate,
passwords, the broker's security properties, each principal's client settings), laid out for
containers: one subfolder per consumer, each mounted (compose ``volume.subpath``) into only the
service that needs it, so no container sees another principal's password.

- ``kafka/`` (mounted at :data:`KAFKA_MOUNT`; the broker's containers append their
  ``KAFKA_*`` environment to its ``server.properties``):
  ``server.properties`` (exactly :meth:`SecureSetup.server_properties`), ``ca.pem``,
  ``admin-client.properties`` (the health check's and the ACL step's ``--command-config``),
  ``scram-users.args`` (the ``kafka-storage format --add-scram`` arguments, one a line) and
  ``create-acls.sh`` (one ``kafka-acls --add`` per group of :func:`acl_plan`).
- ``registry/`` (mounted at :data:`SECRETS_MOUNT`): the server certificate and key, and
  ``users.properties``: Apicurio's embedded users and roles (Quarkus reads it through
  ``QUARKUS_CONFIG_LOCATIONS``).
- ``<role>/`` for every role (mounted at :data:`SECRETS_MOUNT`): ``ca.pem`` and ``dsh.env``,
  the role's ``DSH_*`` client settings (:meth:`SecureSetup.client_env`).

The kafka and registry folders are readable by every uid (those images run as their own users);
each is mounted only into its own services. The role folders keep mode 0700/0600 (the dsh
image's user writes and reads them). A folder already written is kept as it is: the broker's
storage was formatted with its passwords.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path
from typing import Final

from pipeline.adapters.secure.acls import acl_commands, acl_plan
from pipeline.adapters.secure.registry_auth import registry_role
from pipeline.adapters.secure.security import ROLES, SecureSetup
from pipeline.settings import Settings

# Inside the broker's containers: the kafka folder, from which their entrypoint
# (deploy/compose/secure.yml, x-kafka-configured) builds the broker's configuration.
KAFKA_MOUNT: Final = "/etc/dsh/kafka"
SECRETS_MOUNT: Final = "/etc/dsh-secrets"
KAFKA_ACLS_TOOL: Final = "/opt/kafka/bin/kafka-acls.sh"
MARKER: Final = ".complete"  # written last: a folder holding it is whole


def write_compose_secrets(folder: Path, settings: Settings, hosts: list[str]) -> bool:
    """Write every consumer's folder under ``folder`` for ``settings`` (bootstrap, registry
    URL, topic and group prefixes); False when ``folder`` already holds them (kept)."""
    if (folder / MARKER).exists():
        return False
    work = folder / ".setup"
    shutil.rmtree(work, ignore_errors=True)
    write_consumer_folders(folder, SecureSetup.create(work, hosts), settings)
    shutil.rmtree(work)  # the originals: every consumer has its own copies now
    _write(folder / MARKER, "", 0o644)
    return True


def write_consumer_folders(folder: Path, setup: SecureSetup, settings: Settings) -> None:
    """The kafka, registry and per-role folders of ``setup`` under ``folder``."""
    _write_kafka(folder / "kafka", setup, settings)
    _write_registry(folder / "registry", setup)
    for role in ROLES:
        _write_role(folder / role, setup, role, settings)


def role_env(setup: SecureSetup, role: str, settings: Settings) -> dict[str, str]:
    """``role``'s client settings as its container sees them."""
    return setup.client_env(role, settings.bootstrap_servers, settings.registry_url,
                            ca_path=f"{SECRETS_MOUNT}/ca.pem")


def _write_kafka(target: Path, setup: SecureSetup, settings: Settings) -> None:
    _folder(target, 0o755)
    ca = f"{KAFKA_MOUNT}/ca.pem"
    admin = f"{KAFKA_MOUNT}/admin-client.properties"
    shutil.copyfile(setup.pki.ca_file, target / "ca.pem")
    _write(target / "server.properties", setup.server_properties(ca_path=ca) + "\n", 0o644)
    _write(target / "admin-client.properties",
           setup.java_client_properties("admin", ca_path=ca), 0o644)
    _write(target / "scram-users.args", "\n".join(setup.scram_format_args()) + "\n", 0o644)
    lines = ["#!/bin/bash", "set -euo pipefail"]
    for args in acl_commands(acl_plan(settings)):
        lines.append(shlex.join([KAFKA_ACLS_TOOL, "--bootstrap-server",
                                 settings.bootstrap_servers, "--command-config", admin, *args]))
    _write(target / "create-acls.sh", "\n".join(lines) + "\n", 0o755)


def _write_registry(target: Path, setup: SecureSetup) -> None:
    _folder(target, 0o755)
    shutil.copyfile(setup.pki.cert_file, target / "server.pem")
    shutil.copyfile(setup.pki.key_file, target / "server.key")
    os.chmod(target / "server.key", 0o644)
    lines = []
    for role in ROLES:
        lines += [f"quarkus.security.users.embedded.users.{role}={setup.password(role)}",
                  f"quarkus.security.users.embedded.roles.{role}={registry_role(role)}"]
    _write(target / "users.properties", "\n".join(lines) + "\n", 0o644)


def _write_role(target: Path, setup: SecureSetup, role: str, settings: Settings) -> None:
    _folder(target, 0o700)
    shutil.copyfile(setup.pki.ca_file, target / "ca.pem")
    env = role_env(setup, role, settings)
    _write(target / "dsh.env", "".join(f"{k}='{v}'\n" for k, v in env.items()), 0o600)


def _folder(path: Path, mode: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)


def _write(path: Path, text: str, mode: int) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(path, mode)
