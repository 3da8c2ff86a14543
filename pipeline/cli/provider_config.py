"""Settings that hold JSON text or the path of a JSON file, read at start: the driver's
``DSH_PROVIDER_LIMITS`` (rate budgets), ``DSH_PROVIDERS`` (named endpoints) and
``DSH_PROVIDER_FALLBACKS`` (each model's fallbacks); the processors' ``DSH_PRICES`` reads
its text here too. A wrong entry is a ConfigError naming it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from pipeline.adapters.llm.endpoints import ProviderEndpoint, parse_providers
from pipeline.adapters.llm.factory import PROVIDER_NAMES
from pipeline.core.errors import ConfigError
from pipeline.core.provider_routes import Fallbacks, parse_fallbacks
from pipeline.core.rate_budget import ProviderLimits, parse_limits
from pipeline.settings import Settings


def setting_text(variable: str, value: str) -> str | None:
    """The JSON text of a setting that holds JSON text or the path of a JSON file (None:
    empty); ConfigError naming the variable when the file cannot be read."""
    raw = value.strip()
    if not raw:
        return None
    if raw.startswith("{"):
        return raw
    try:
        return Path(raw).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{variable} file {value!r} cannot be read: "
                          f"{exc.strerror or exc}") from None


def json_setting(variable: str, value: str) -> object | None:
    """The decoded JSON of a setting holding JSON text or a file's path (None: empty)."""
    raw = setting_text(variable, value)
    if raw is None:
        return None
    try:
        decoded: object = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{variable} is not JSON: {exc}") from None
    return decoded


def provider_limits_of(settings: Settings) -> ProviderLimits | None:
    """``DSH_PROVIDER_LIMITS`` (None: not set)."""
    raw = json_setting("DSH_PROVIDER_LIMITS", settings.provider_limits)
    return None if raw is None else parse_limits(raw)


def provider_endpoints_of(settings: Settings, env: Mapping[str, str]
                          ) -> dict[str, ProviderEndpoint]:
    """``DSH_PROVIDERS``, keys read from ``env`` (the process environment)."""
    raw = json_setting("DSH_PROVIDERS", settings.providers)
    return {} if raw is None else parse_providers(raw, env)


def fallbacks_of(settings: Settings, endpoints: Mapping[str, ProviderEndpoint]
                 ) -> Fallbacks | None:
    """``DSH_PROVIDER_FALLBACKS`` (None: not set); every provider it names must be built
    in or an endpoint of ``DSH_PROVIDERS``."""
    raw = json_setting("DSH_PROVIDER_FALLBACKS", settings.provider_fallbacks)
    if raw is None:
        return None
    return parse_fallbacks(raw, known_providers=PROVIDER_NAMES | set(endpoints))
