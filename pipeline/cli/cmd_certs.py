"""``dsh-pipeline certs DIR``: a secure deployment's CA, certificates and credentials.

Writes what ``deploy/compose/secure.yml`` mounts (:mod:`pipeline.adapters.secure.compose`):
a new CA and a server certificate valid for the hosts of ``DSH_BOOTSTRAP_SERVERS`` and
``DSH_REGISTRY_URL`` (plus ``localhost``, ``127.0.0.1`` and every ``--host``), one password per
principal, the broker's security properties, its SCRAM users and ACL commands, the registry's
users, and one env file per role. Secrets go to files only; stdout names the folder. A folder
already written is kept (exit 0), since a broker was formatted with its passwords.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pipeline.cli.common import add_logging_options, configure_logging
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "certs", help="write a secure deployment's CA, certificates and per-role credentials",
        description="Write a new CA, server certificate, passwords and per-role env files "
                    "into DIR for the secure compose stack (deploy/compose/secure.yml).")
    parser.add_argument("folder", type=Path, metavar="DIR", help="where to write (kept if "
                        "already written)")
    parser.add_argument("--host", action="append", default=[], metavar="NAME",
                        help="another name or address for the server certificate "
                             "(repeatable)")
    add_logging_options(parser)
    parser.set_defaults(func=run)


def certificate_hosts(settings: Settings, extra: list[str]) -> list[str]:
    """The server certificate's names: the brokers' and the registry's hosts, loopback, extras."""
    hosts = [address.rsplit(":", 1)[0] for address in settings.bootstrap_servers.split(",")]
    registry = urlsplit(settings.registry_url).hostname
    if registry:
        hosts.append(registry)
    hosts += ["localhost", "127.0.0.1", *extra]
    return list(dict.fromkeys(host for host in hosts if host))


def run(args: argparse.Namespace, settings: Settings) -> int:
    from pipeline.adapters.secure.compose import write_compose_secrets

    configure_logging(args)
    hosts = certificate_hosts(settings, args.host)
    if write_compose_secrets(args.folder, settings, hosts):
        print(f"written {args.folder} (certificate for {', '.join(hosts)})", flush=True)
    else:
        print(f"kept {args.folder} (already written)", flush=True)
    return 0
