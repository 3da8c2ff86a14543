"""``dsh-pipeline topics``: create and check the project's topics on any cluster.

``topics ensure`` is what deployments run once before the services (the compose ``topics``
service, the Kubernetes Job): it creates every missing topic with its configuration
(DESIGN.md section 2), refuses existing ones that do not match, and, unless
``--no-registry``, registers today's value schemas (session events, inbox commands and the
derived outputs: derived-message changes, usage records, fleet status) under
``<topic>-value`` with compatibility BACKWARD_TRANSITIVE set explicitly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.registry.client import RegistryClient
from pipeline.adapters.registry.outputs import register_output_schemas
from pipeline.cli.registry_codecs import registry_codecs
from pipeline.settings import Settings


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "topics", help="create and check the project's topics (and register schemas)",
        description=__doc__)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    ensure = actions.add_parser(
        "ensure", help="create missing topics, refuse mismatched ones, register schemas",
        description="Idempotent: run it before the services, as often as you like.")
    ensure.add_argument("--no-registry", action="store_true",
                        help="do not register the value schemas (no registry in use)")
    ensure.set_defaults(func=run_ensure)


def run_ensure(args: argparse.Namespace, settings: Settings) -> int:
    report = asyncio.run(ensure_topics(settings))
    summary: dict[str, Any] = {"created": list(report.created),
                               "existing": list(report.existing)}
    if not args.no_registry:
        with RegistryClient.from_settings(settings) as client:
            registry_codecs(settings, client)  # registers both subjects, rule set explicitly
            register_output_schemas(client, settings.topics)  # derived-messages, usage, fleet
        summary["registry"] = settings.registry_url
    print(json.dumps(summary), flush=True)
    return 0
