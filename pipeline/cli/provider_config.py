"""The driver's provider settings read at start: ``DSH_PROVIDERS`` (named endpoints) and
``DSH_PROVIDER_FALLBACKS`` (each model's fallbacks), each JSON text or the path of a JSON
file, as ``DSH_PROVIDER_LIMITS``. A wrong entry is a ConfigError naming it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from pipeline.adapters.llm.endpoints import ProviderEndpoint, parse_providers
from pipeline.adapters.llm.factory import PROVIDER_NAMES
from pipeline.core.errors import ConfigError
from pipeline.core.provider_routes import Fallbacks, parse_fallbacks
from pipeline.settings import Settings


def json_setting(variable: str, value: str) -> object | None:
    """The decoded JSON of a setting holding JSON text or a file's path (None: empty)."""
    raw = value.strip()
    if not raw:
        return None
    if not raw.startswith("{"):
        try:
            raw = Path(raw).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{variable} file {value!r} cannot be read: "
                              f"{exc.strerror or exc}") from None
    try:
        decoded: object = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{variable} is not JSON: {exc}") from None
    return decoded


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
