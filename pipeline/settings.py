"""Typed settings, read once from the environment (prefix ``DSH_``) at the composition root.

Built by the CLI and passed down; nothing else reads the environment. Secrets are
:class:`Secret` values whose ``repr``/``str`` are masked, so printing a Settings object, an
error or a log line can never reveal them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Final

from pipeline.core.errors import ConfigError

__all__ = ["MASK", "Secret", "Settings", "TopicNames"]

MASK: Final = "********"
# The processors' default app name: the end of their consumer group id.
PROCESSORS_APP_NAME: Final = "processors"


@dataclass(frozen=True, slots=True)
class Secret:
    """A secret string: masked wherever it is printed; ``reveal()`` only where it is used."""

    _value: str = field(repr=False)

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"Secret({MASK})" if self._value else "Secret('')"

    def __str__(self) -> str:
        return MASK if self._value else ""

    def __bool__(self) -> bool:
        return bool(self._value)


@dataclass(frozen=True, slots=True)
class TopicNames:
    """The project's topic names under one prefix (DESIGN.md section 2)."""

    prefix: str

    @property
    def session_events(self) -> str:
        return f"{self.prefix}session-events"

    @property
    def inbox(self) -> str:
        return f"{self.prefix}inbox"

    @property
    def derived_messages(self) -> str:
        return f"{self.prefix}derived-messages"

    @property
    def usage(self) -> str:
        return f"{self.prefix}usage"

    @property
    def fleet(self) -> str:
        return f"{self.prefix}fleet"

    @property
    def spill(self) -> str:
        return f"{self.prefix}spill"

    @property
    def driver_checkpoints(self) -> str:
        """Compacted, one record per session: what a driver needs to continue it."""
        return f"{self.prefix}driver-checkpoints"

    @staticmethod
    def dlq(topic: str) -> str:
        return f"{topic}.dlq"


@dataclass(frozen=True, slots=True)
class Settings:
    """Every setting, with its environment variable ``DSH_<NAME upper>`` and default."""

    bootstrap_servers: str = "127.0.0.1:9092"
    topic_prefix: str = "dsh."
    partitions: int = 6
    replication_factor: int = 1
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password: Secret = Secret("")
    ssl_cafile: str = ""
    registry_url: str = "http://127.0.0.1:8081/apis/ccompat/v7"
    registry_username: str = ""
    registry_password: Secret = Secret("")
    provider: str = "scripted"
    model: str = "scripted-1"
    provider_base_url: str = "https://api.deepseek.com"
    deepseek_api_key: Secret = Secret("")
    group_id_prefix: str = "dsh-"
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8780
    dashboard_token: Secret = Secret("")
    dashboard_tls_cert: str = ""
    dashboard_tls_key: str = ""
    dashboard_processors_url: str = ""
    processors_web_port: int = 6066
    driver_metrics_port: int = 9464
    state_dir: str = ".cache/state"
    otlp_endpoint: str = "http://127.0.0.1:4318"
    otlp_headers: Secret = Secret("")
    otel_metrics_port: int = 9465
    max_record_bytes: int = 8 * 1024 * 1024
    spill_inline_bytes: int = 50_000
    mcp_config: str = ""
    tool_timeout: float = 60.0
    driver_idle_evict: float = 600.0
    provider_limits: str = ""
    prices: str = ""
    providers: str = ""
    provider_fallbacks: str = ""

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.topic_prefix)

    def processors_group(self, app_name: str = PROCESSORS_APP_NAME) -> str:
        """The processors' faust app id: their consumer group id, and the prefix of their
        changelog and repartition topics. Every place that names them (the worker, the
        dashboard's lag panel, the ACL plan) asks here.

        ``dsh-dsh.processors`` by default is the group prefix (``dsh-``) and the topic prefix
        (``dsh.``), not one prefix twice: the id scopes a group and a deployment's topics. It
        stays as it is: a new id would be a new group and new changelog topics for every
        running deployment, outside its ACLs (docs/decisions/processors-group-id.md)."""
        return f"{self.group_id_prefix}{self.topic_prefix}{app_name}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read ``DSH_*`` variables (and ``DEEPSEEK_API_KEY``); ``overrides`` win."""
        source = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = cls.env_var(f.name)
            raw = source.get(name)
            if f.name == "deepseek_api_key" and raw is None:
                raw = source.get("DEEPSEEK_API_KEY")
            if raw is not None:
                values[f.name] = _convert(f.name, str(f.type), raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = replace(cls(), **values)
        _check_sizes(settings)
        return settings

    @staticmethod
    def env_var(field_name: str) -> str:
        """The environment variable of a field: ``DSH_<NAME>``."""
        return f"DSH_{field_name.upper()}"

    def to_env(self) -> dict[str, str]:
        """The ``DSH_*`` variables that give a child process exactly these settings.

        Secrets are revealed here, for the child's environment only: never print the result.
        """
        return {self.env_var(f.name): (value.reveal() if isinstance(value, Secret)
                                       else str(value))
                for f in fields(self) for value in (getattr(self, f.name),)}

    def describe(self) -> dict[str, str]:
        """Every setting as text, secrets masked: safe to print or log."""
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}


MIN_RECORD_BYTES: Final = 1024 * 1024


def _check_sizes(settings: Settings) -> None:
    """The record limit can carry a spill chunk (1 MB) and the inline cap fits well inside;
    the tool timeout and the idle eviction are positive."""
    if settings.max_record_bytes < MIN_RECORD_BYTES:
        raise ConfigError(f"DSH_MAX_RECORD_BYTES must be at least {MIN_RECORD_BYTES} "
                          f"(1 MiB), got {settings.max_record_bytes}")
    if not settings.tool_timeout > 0:
        raise ConfigError(f"DSH_TOOL_TIMEOUT must be a positive number of seconds, got "
                          f"{settings.tool_timeout}")
    if not settings.driver_idle_evict > 0:
        raise ConfigError(f"DSH_DRIVER_IDLE_EVICT must be a positive number of seconds, got "
                          f"{settings.driver_idle_evict}")
    if not 0 < settings.spill_inline_bytes <= settings.max_record_bytes // 4:
        raise ConfigError(f"DSH_SPILL_INLINE_BYTES must be 1..{settings.max_record_bytes // 4} "
                          f"(a quarter of DSH_MAX_RECORD_BYTES), got "
                          f"{settings.spill_inline_bytes}")


def _convert(name: str, type_name: str, raw: str) -> Any:
    if "Secret" in type_name:
        return Secret(raw)
    if type_name == "int":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"DSH_{name.upper()} must be an integer, got {raw!r}") from None
    if type_name == "float":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"DSH_{name.upper()} must be a number, got {raw!r}") from None
    return raw
