"""A secure deployment's identities (the secure local stack's, ``certs``): principals, passwords,
broker and client settings.

``SecureSetup.create(folder)`` makes a run folder (never inside the checkout's tracked files):
a fresh CA and server certificate (:mod:`.tls`), one random password per principal, and, once
the stack's addresses are known, one env file per role (``env/<role>.env``) holding the
``DSH_*`` client settings of that principal. Passwords live only in files of mode 0600 (the
env files, the brokers' properties, the admin's command config) and in child environments;
they are never printed or logged: ``describe()`` names files, not secrets.

Kafka listeners (rendered into each node's ``server.properties``):

- the client and inter-broker listener ``SASL_SSL`` with SCRAM-SHA-512; the SCRAM users are
  written into the metadata log at format time (``--add-scram``, on every node);
- the controller listener is SASL_SSL with PLAIN: controller-to-controller SCRAM does not work
  (KAFKA-15513), so the controllers authenticate with PLAIN, over TLS, as the ``broker``
  principal whose users are listed in the listener's own JAAS line;
- ``StandardAuthorizer`` with ``super.users=User:broker;User:admin`` and no
  ``allow.everyone.if.no.acl.found``: every other principal has exactly its ACLs
  (:mod:`.acls`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from pipeline.adapters.secure.tls import DEFAULT_HOSTS, Pki, make_pki

ROLES: Final = ("driver", "processors", "dashboard", "ingest", "replay", "otel", "admin")
BROKER: Final = "broker"
SUPER_USERS: Final = (BROKER, "admin")
MECHANISM: Final = "SCRAM-SHA-512"
CLIENT_LISTENER: Final = "SASL_SSL"
SCRAM_MODULE: Final = "org.apache.kafka.common.security.scram.ScramLoginModule"
PLAIN_MODULE: Final = "org.apache.kafka.common.security.plain.PlainLoginModule"
AUTHORIZER: Final = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


@dataclass(frozen=True, slots=True)
class SecureSetup:
    """One run's certificates and credentials (``passwords`` holds every principal's)."""

    folder: Path
    pki: Pki
    passwords: Mapping[str, str]
    controller_password: str

    @classmethod
    def create(cls, folder: Path, hosts: Sequence[str] = DEFAULT_HOSTS) -> SecureSetup:
        """A new CA, a server certificate valid for ``hosts``, and fresh passwords."""
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        pki = make_pki(folder / "tls", hosts)
        passwords = {name: secrets.token_urlsafe(18) for name in (*ROLES, BROKER)}
        return cls(folder, pki, passwords, secrets.token_urlsafe(18))

    def password(self, principal: str) -> str:
        return self.passwords[principal]

    @property
    def env_dir(self) -> Path:
        return self.folder / "env"

    def env_file(self, role: str) -> Path:
        return self.env_dir / f"{role}.env"

    @property
    def admin_properties(self) -> Path:
        """The admin's Java client settings (``kafka-acls --command-config``)."""
        return self.folder / "admin-client.properties"

    # -- broker side --------------------------------------------------------------------------
    def scram_format_args(self) -> list[str]:
        """``kafka-storage format`` arguments creating every SCRAM user (broker included)."""
        args: list[str] = []
        for name, password in self.passwords.items():
            args += ["--add-scram", f"{MECHANISM}=[name={name},password={password}]"]
        return args

    def server_properties(self, ca_path: str | None = None) -> str:
        """The security lines of a node's ``server.properties`` (after the listener lines);
        ``ca_path``: where the broker finds the CA file, when not where it was written (a
        container's mount)."""
        broker = self.passwords[BROKER]
        controller = self.controller_password
        return "\n".join([
            f"sasl.enabled.mechanisms={MECHANISM}",
            f"sasl.mechanism.inter.broker.protocol={MECHANISM}",
            f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config={SCRAM_MODULE} "
            f'required username="{BROKER}" password="{broker}";',
            "# KAFKA-15513: SCRAM between controllers is unsupported; PLAIN over TLS instead.",
            "sasl.mechanism.controller.protocol=PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms=PLAIN",
            f"listener.name.controller.plain.sasl.jaas.config={PLAIN_MODULE} required "
            f'username="{BROKER}" password="{controller}" user_{BROKER}="{controller}";',
            # Inline PEM (a file-based PEM keystore needs an encrypted key, and Java 17
            # reads no PBES2-encrypted key); Kafka hides both values in its logs.
            "ssl.keystore.type=PEM",
            "ssl.keystore.key=" + _properties_text(self.pki.key_file.read_text()),
            "ssl.keystore.certificate.chain=" + _properties_text(self.pki.cert_file.read_text()),
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={ca_path or self.pki.ca_file}",
            f"authorizer.class.name={AUTHORIZER}",
            "super.users=" + ";".join(f"User:{u}" for u in SUPER_USERS),
            "allow.everyone.if.no.acl.found=false",
        ])

    @staticmethod
    def listener_lines(port: int, controller_port: int) -> str:
        """The listener lines of a node: SASL_SSL for clients and brokers, and controllers."""
        listeners = f"{CLIENT_LISTENER}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}"
        return "\n".join([
            f"listeners={listeners}",
            f"advertised.listeners={listeners}",
            f"listener.security.protocol.map=CONTROLLER:SASL_SSL,{CLIENT_LISTENER}:SASL_SSL",
            "controller.listener.names=CONTROLLER",
            f"inter.broker.listener.name={CLIENT_LISTENER}",
        ])

    # -- client side --------------------------------------------------------------------------
    def client_env(self, role: str, bootstrap: str, registry_url: str = "",
                   ca_path: str | None = None) -> dict[str, str]:
        """The ``DSH_*`` settings of ``role``'s principal (secrets included: never print)."""
        env = {
            "DSH_BOOTSTRAP_SERVERS": bootstrap,
            "DSH_SECURITY_PROTOCOL": CLIENT_LISTENER,
            "DSH_SASL_MECHANISM": MECHANISM,
            "DSH_SASL_USERNAME": role,
            "DSH_SASL_PASSWORD": self.passwords[role],
            "DSH_SSL_CAFILE": ca_path or str(self.pki.ca_file),
        }
        if registry_url:
            env |= {"DSH_REGISTRY_URL": registry_url, "DSH_REGISTRY_USERNAME": role,
                    "DSH_REGISTRY_PASSWORD": self.passwords[role]}
        return env

    def write_client_files(self, bootstrap: str, registry_url: str = "") -> dict[str, Path]:
        """One env file per role, and the admin's Java client properties; role -> env file."""
        self.env_dir.mkdir(exist_ok=True)
        written: dict[str, Path] = {}
        for role in ROLES:
            lines = [f"{k}={_shell_quote(v)}"
                     for k, v in self.client_env(role, bootstrap, registry_url).items()]
            _write_private(self.env_file(role), "\n".join(lines) + "\n")
            written[role] = self.env_file(role)
        _write_private(self.admin_properties, self.java_client_properties("admin"))
        return written

    def java_client_properties(self, principal: str, ca_path: str | None = None) -> str:
        """Java client settings of ``principal`` (for Kafka's own command-line tools)."""
        return "\n".join([
            "security.protocol=SASL_SSL",
            f"sasl.mechanism={MECHANISM}",
            f"sasl.jaas.config={SCRAM_MODULE} required username=\"{principal}\" "
            f"password=\"{self.passwords[principal]}\";",
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={ca_path or self.pki.ca_file}",
        ]) + "\n"


def read_env_file(path: Path) -> dict[str, str]:
    """The variables of an env file written by :meth:`SecureSetup.write_client_files`."""
    env: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            env[key.strip()] = value.strip().strip("'")
    return env


def _properties_text(text: str) -> str:
    """A multi-line value as one .properties line (``\\n`` escapes, read back as newlines)."""
    return text.strip().replace("\n", "\\n")


def _shell_quote(value: str) -> str:
    """Single-quoted for ``source``/``set -a`` (values never hold a quote: URL-safe tokens)."""
    return f"'{value}'"


def _write_private(path: Path, text: str) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
