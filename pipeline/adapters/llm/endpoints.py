"""``DSH_PROVIDERS``: named provider endpoints, each with its own base URL and key.

A JSON object mapping a provider name (what sessions, limits and fallbacks call it) to its
endpoint, in dsh's own words (its DeepSeek adapter takes ``baseURL`` and ``apiKeyEnv``)::

    {"backup": {"kind": "openai-compatible", "baseURL": "https://api.example.com/v1",
                "apiKeyEnv": "BACKUP_API_KEY"},
     "deepseek": {"kind": "deepseek", "apiKeyEnv": "DEEPSEEK_API_KEY"}}

``kind`` is ``deepseek``, ``openai-compatible`` or ``scripted``. ``apiKeyEnv`` is the *name* of
the environment variable holding the key: a key is never written in the setting itself (a
``apiKey`` entry is refused), and the key read from it is a :class:`Secret` (masked wherever
printed). A name defined here overrides the built-in provider of that name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from pipeline.core.errors import ConfigError
from pipeline.settings import Secret

KINDS: Final = ("deepseek", "openai-compatible", "scripted")
FIELDS: Final = frozenset({"kind", "baseURL", "apiKeyEnv"})
PROVIDERS_EXAMPLE: Final = ('{"backup": {"kind": "openai-compatible", "baseURL": '
                            '"https://api.example.com/v1", "apiKeyEnv": "BACKUP_API_KEY"}}')


@dataclass(frozen=True, slots=True)
class ProviderEndpoint:
    """One named endpoint; ``api_key`` was read from the variable ``api_key_env``."""

    name: str
    kind: str
    base_url: str = ""
    api_key_env: str = ""
    api_key: Secret = field(default=Secret(""))


def parse_providers(raw: object, env: Mapping[str, str]) -> dict[str, ProviderEndpoint]:
    """The endpoints of a decoded ``DSH_PROVIDERS`` object, keys read from ``env``;
    ConfigError naming the entry that is wrong (never a key's value)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"DSH_PROVIDERS must be a JSON object, e.g. {PROVIDERS_EXAMPLE}")
    return {name: _endpoint(name, entry, env) for name, entry in raw.items()}


def _endpoint(name: str, entry: object, env: Mapping[str, str]) -> ProviderEndpoint:
    where = f"DSH_PROVIDERS[{name!r}]"
    if not name or "/" in name:
        raise ConfigError(f"{where}: a provider name must be non-empty and hold no '/'")
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be an object with kind, baseURL and apiKeyEnv")
    if "apiKey" in entry:
        raise ConfigError(f"{where} holds an apiKey: name the environment variable that "
                          "holds the key in apiKeyEnv instead (a key never goes in a setting)")
    unknown = sorted(set(entry) - FIELDS)
    if unknown:
        hint = " (spelled baseURL)" if "baseUrl" in unknown else ""
        raise ConfigError(f"{where} has unknown field(s) {', '.join(unknown)}{hint}; "
                          f"known: {', '.join(sorted(FIELDS))}")
    kind, base_url, key_env = entry.get("kind"), entry.get("baseURL", ""), \
        entry.get("apiKeyEnv", "")
    if kind not in KINDS:
        raise ConfigError(f"{where}.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(base_url, str) or not isinstance(key_env, str):
        raise ConfigError(f"{where}.baseURL and .apiKeyEnv must be strings")
    if kind == "openai-compatible" and not base_url:
        raise ConfigError(f"{where} (openai-compatible) needs a baseURL")
    if base_url and not base_url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}.baseURL must start with http:// or https://")
    if kind == "deepseek" and not key_env:
        raise ConfigError(f"{where} (deepseek) needs apiKeyEnv: the name of the environment "
                          "variable holding its key")
    key = Secret("")
    if key_env:
        value = env.get(key_env, "")
        if not value:
            raise ConfigError(f"{where}.apiKeyEnv names {key_env}, which is not set")
        key = Secret(value)
    return ProviderEndpoint(name, kind, base_url, key_env, key)
