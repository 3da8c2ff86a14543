"""Kafka's ``kafka-acls`` (``org.apache.kafka.tools.AclCommand``; aiokafka has no ACL calls) run
over the local stack: the ACL plan of :mod:`pipeline.adapters.secure.acls`, every group of
commands in one JVM (``files/AclBatch.java``), with ``--command-config`` holding the admin's
client settings.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Final

from dsh_dev.localstack.artifacts import DEPLOY_DIR
from pipeline.adapters.secure.acls import AclRule, acl_commands
from pipeline.core.errors import BrokerError

ACL_TOOL_MAIN: Final = "org.apache.kafka.tools.AclCommand"
ACL_TOOL_TIMEOUT_S: Final = 180.0


def apply_acls(java: str, classpath: str, bootstrap: str, command_config: Path,
               rules: list[AclRule], *, remove: bool = False) -> int:
    """Create (or remove) ``rules`` through ``kafka-acls``, every group in one JVM
    (``AclBatch.java`` calls AclCommand once per group); the number of groups. Raises
    BrokerError."""
    commands = acl_commands(rules, remove=remove)
    arguments = command_config.with_name("acl-commands.tsv")
    arguments.write_text("".join(
        "\t".join(["--bootstrap-server", bootstrap, "--command-config", str(command_config),
                   *args]) + "\n" for args in commands), encoding="utf-8")
    argv = [java, "-Xmx192m", "-XX:TieredStopAtLevel=1", "-cp", classpath,
            str(DEPLOY_DIR / "AclBatch.java"), str(arguments)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False,
                              timeout=ACL_TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BrokerError(f"kafka-acls ({ACL_TOOL_MAIN}) failed: {exc}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise BrokerError(f"kafka-acls ({ACL_TOOL_MAIN}) failed (exit {done.returncode}); "
                          f"the commands are in {arguments}:\n{tail}")
    return len(commands)
