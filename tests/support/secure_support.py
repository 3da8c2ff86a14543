"""A secure local stack for tests: TLS + SASL/SCRAM-SHA-512 Kafka with the ACL plan, and the
registry on HTTPS with basic auth, on free ports, its topics and schemas provisioned by the
admin (as ``dsh-pipeline broker --secure`` does).

``SecureStack.role(name)`` gives the settings of one role's principal; ``env(name)`` the same
as environment variables for a child ``dsh-pipeline`` process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Final

from dsh_dev.cli.cmd_broker import prepare_stack, role_settings
from dsh_dev.localstack.artifacts import Artifacts
from dsh_dev.localstack.stack import LocalStack
from pipeline.adapters.secure.acls import acl_plan
from pipeline.adapters.secure.security import ROLES, SecureSetup, read_env_file
from pipeline.settings import Settings

READY_BUDGET_S: Final = 300.0
SECURE_PREFIX: Final = "sec."
TEST_PARTITIONS: Final = 3


class SecureStack:
    """Started by :meth:`start`, stopped (and its folder removed) by :meth:`stop`."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="dsh-test-secure-"))
        self.base = Settings(topic_prefix=SECURE_PREFIX, partitions=TEST_PARTITIONS,
                             state_dir=str(self.folder / "state"))
        self.security = SecureSetup.create(self.folder / "run")
        self.stack = LocalStack(Artifacts.default(), security=self.security,
                                acl_rules=acl_plan(self.base), workdir=self.folder / "stack")

    def start(self) -> SecureStack:
        self.stack.start(budget_s=READY_BUDGET_S)
        prepare_stack(self.stack, self.base, 1)
        return self

    def stop(self) -> None:
        self.stack.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def role(self, name: str) -> Settings:
        """The settings of ``name``'s principal (one of ROLES)."""
        assert name in ROLES, name
        return role_settings(self.stack, self.base, 1, name)

    def env(self, name: str) -> dict[str, str]:
        """A child process's environment as ``name``'s principal."""
        return {**os.environ, **self.role(name).to_env(),
                **read_env_file(self.security.env_file(name))}

    def password(self, name: str) -> str:
        return self.security.password(name)

    @property
    def passwords(self) -> list[str]:
        return [*self.security.passwords.values(), self.security.controller_password]
