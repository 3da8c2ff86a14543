"""The least-privilege ACLs of each role's principal, created with Kafka's own ``kafka-acls``.

:func:`acl_plan` is the whole policy as data (principal, resource, pattern, operations, why);
docs/security.md shows it as a table. :func:`acl_commands` turns it into ``kafka-acls``
arguments, one command per (principal, resource type, pattern type, operations) group: the
secure compose stack runs them (:mod:`.compose`), the local stack of the development package
runs them all in one JVM (``dsh_dev.localstack.acl_tool``). The admin and the brokers are super
users and get no ACL; no principal gets a wildcard.

Names follow the settings: ``P`` the topic prefix, ``G`` the group id prefix. The processors'
faust app id is ``G + P + "processors"``; faust creates its changelog and repartition topics
under it, so that principal gets prefixed ACLs on its own app id only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Final

from pipeline.settings import Settings

READ: Final = ("Read", "Describe")
WRITE: Final = ("Write", "Describe")
READ_WRITE: Final = ("Read", "Write", "Describe")
OWN_TOPICS: Final = ("Create", "Read", "Write", "Describe", "DescribeConfigs")


@dataclass(frozen=True, slots=True)
class AclRule:
    """Allow ``principal`` the ``operations`` on one resource (literal name or prefix)."""

    principal: str
    resource: str          # "topic", "group" or "transactional-id"
    name: str
    operations: tuple[str, ...]
    why: str
    prefixed: bool = False


def acl_plan(settings: Settings) -> list[AclRule]:
    """Every role's ACLs for the topic and group names of ``settings``."""
    return [*_driver(settings), *_processors(settings), *_dashboard(settings),
            *_ingest(settings), *_replay(settings), *_otel(settings)]


def _driver(s: Settings) -> list[AclRule]:
    t, g = s.topics, s.group_id_prefix
    rules = [
        AclRule("driver", "topic", t.inbox, READ, "consume agent commands"),
        AclRule("driver", "topic", t.session_events, READ_WRITE,
                "append session events; read a session back to resume it"),
        AclRule("driver", "topic", t.dlq(t.inbox), WRITE, "dead-letter undecodable commands"),
        AclRule("driver", "topic", t.driver_checkpoints, READ_WRITE,
                "checkpoint each session it writes; load a session from its checkpoint"),
    ]
    for group in (f"{g}driver", f"{g}demo-driver"):
        rules += [
            AclRule("driver", "group", group, ("Read", "Describe"), "its consumer group"),
            AclRule("driver", "transactional-id", f"{group}-driver-p", ("Write", "Describe"),
                    "one transactional producer per inbox partition", prefixed=True),
        ]
    return rules


def _processors(s: Settings) -> list[AclRule]:
    t, app = s.topics, s.processors_group()
    return [
        AclRule("processors", "topic", t.session_events, READ, "fold session events"),
        AclRule("processors", "topic", t.derived_messages, WRITE,
                "write derived messages (and replayed versions .vN)", prefixed=True),
        AclRule("processors", "topic", t.usage, WRITE, "write usage records"),
        AclRule("processors", "topic", t.fleet, WRITE, "write fleet status"),
        AclRule("processors", "topic", t.dlq(t.session_events), READ_WRITE,
                "dead-letter events that break a rule (read: a record read again after a "
                "crash is not dead-lettered twice)"),
        AclRule("processors", "topic", f"{t.prefix}projection-versions", ("Create", *READ_WRITE),
                "follow the active projection version (created by whoever needs it first); "
                "acknowledge a handover"),
        AclRule("processors", "topic", app, OWN_TOPICS,
                "faust's own changelog, repartition and assignor topics", prefixed=True),
        AclRule("processors", "group", app, ("Read", "Describe"),
                "faust's consumer group (the app id)", prefixed=True),
        AclRule("processors", "transactional-id", app, ("Write", "Describe"),
                "the dead letters' producers, one per partition (`<app>-dlq-p<p>`: "
                "a new owner fences the old); faust's, should exactly-once be turned on",
                prefixed=True),
    ]


def _dashboard(s: Settings) -> list[AclRule]:
    t, g = s.topics, s.group_id_prefix
    reads = [(t.session_events, False), (t.inbox, False), (t.derived_messages, True),
             (t.usage, False), (t.fleet, False), (f"{t.prefix}projection-versions", False)]
    rules = [AclRule("dashboard", "topic", name, READ, "show sessions, fleet and usage; tail, "
                     "export", prefixed=prefixed) for name, prefixed in reads]
    # Kafka lists, and answers the offsets of, only the groups a principal may Describe.
    rules += [AclRule("dashboard", "group", group, ("Describe",),
                      "the lag panel and alerts: its committed offsets and members")
              for group in (f"{g}driver", f"{g}demo-driver", s.processors_group(), f"{g}otel")]
    return rules


def _otel(s: Settings) -> list[AclRule]:
    t, g = s.topics, s.group_id_prefix
    return [
        AclRule("otel", "topic", t.session_events, READ, "export every ended turn as a trace"),
        AclRule("otel", "topic", t.dlq(t.session_events), WRITE,
                "dead-letter a turn the OTLP receiver refused (400)"),
        AclRule("otel", "group", f"{g}otel", ("Read", "Describe"), "its consumer group"),
    ]


def _ingest(s: Settings) -> list[AclRule]:
    t, base = s.topics, f"{s.group_id_prefix}{s.topic_prefix}"
    rules = [
        AclRule("ingest", "topic", t.session_events, READ_WRITE,
                "import/ship session logs; read the last seq of each session"),
        AclRule("ingest", "topic", t.inbox, WRITE, "`send`: post agent commands"),
        AclRule("ingest", "topic", t.driver_checkpoints, WRITE,
                "mark an imported session as written by dsh (the driver does not drive it)"),
    ]
    for name in ("import", "ship-"):
        rules += [
            AclRule("ingest", "group", f"{base}{name}", ("Read", "Describe"),
                    "its transactions' group", prefixed=True),
            AclRule("ingest", "transactional-id", f"{base}{name}", ("Write", "Describe"),
                    "one transactional importer/shipper at a time (fencing)", prefixed=True),
        ]
    return rules


def _replay(s: Settings) -> list[AclRule]:
    t = s.topics
    return [
        AclRule("replay", "topic", t.session_events, READ, "rebuild projections from events"),
        AclRule("replay", "topic", t.derived_messages, ("Create", *READ_WRITE),
                "create and write a new projection version .vN", prefixed=True),
        AclRule("replay", "topic", f"{t.prefix}projection-versions", ("Create", *READ_WRITE),
                "claim a version, request and complete the handover"),
    ]


def acl_commands(rules: list[AclRule], *, remove: bool = False) -> list[list[str]]:
    """``kafka-acls --add`` (or ``--remove --force``) arguments, one list per (principal,
    resource type, pattern, operations) group (the tool applies every operation to every
    resource it is given)."""
    def key(rule: AclRule) -> tuple[str, str, bool, tuple[str, ...]]:
        return rule.principal, rule.resource, rule.prefixed, rule.operations

    commands = []
    for (principal, resource, prefixed, operations), group in itertools.groupby(
            sorted(rules, key=key), key=key):
        action = ["--remove", "--force"] if remove else ["--add"]
        args = [*action, "--allow-principal", f"User:{principal}",
                "--resource-pattern-type", "prefixed" if prefixed else "literal"]
        for rule in group:
            args += [f"--{resource}", rule.name]
        for operation in operations:
            args += ["--operation", operation]
        commands.append(args)
    return commands
