"""Choosing a model provider by name from the settings (used by the composition root)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from pipeline.adapters.llm.base import ModelProvider
from pipeline.adapters.llm.endpoints import ProviderEndpoint
from pipeline.adapters.llm.http_provider import (
    DEEPSEEK_BASE_URL,
    DeepSeekProvider,
    OpenAICompatibleProvider,
)
from pipeline.adapters.llm.scripted import Script, ScriptedProvider, echo_script
from pipeline.core.errors import ConfigError
from pipeline.settings import Settings

DEEPSEEK_NAMES: Final = frozenset({"deepseek", "deepseek-official"})
OPENAI_NAMES: Final = frozenset({"openai", "openai-compatible"})
SCRIPTED_NAMES: Final = frozenset({"scripted"})
PROVIDER_NAMES: Final = DEEPSEEK_NAMES | OPENAI_NAMES | SCRIPTED_NAMES


def provider_from_settings(settings: Settings, name: str | None = None, *,
                           script: Script = echo_script,
                           endpoints: Mapping[str, ProviderEndpoint] | None = None
                           ) -> ModelProvider:
    """The provider called ``name`` (default ``settings.provider``).

    A name of ``endpoints`` (``DSH_PROVIDERS``, :mod:`.endpoints`) is that endpoint; else
    DeepSeek and OpenAI-compatible endpoints use ``settings.provider_base_url`` and the
    key in ``settings.deepseek_api_key`` (DEEPSEEK_API_KEY); ``scripted`` uses ``script``.
    """
    chosen = name or settings.provider
    endpoint = (endpoints or {}).get(chosen)
    if endpoint is not None:
        return provider_of_endpoint(endpoint, script=script)
    if chosen in SCRIPTED_NAMES:
        return ScriptedProvider(script, name=chosen)
    if chosen in DEEPSEEK_NAMES:
        return DeepSeekProvider(settings.deepseek_api_key, settings.provider_base_url)
    if chosen in OPENAI_NAMES:
        return OpenAICompatibleProvider(settings.provider_base_url, settings.deepseek_api_key)
    raise ConfigError(f"unknown model provider {chosen!r} (DSH_PROVIDER); known: "
                      f"{', '.join(sorted(PROVIDER_NAMES | set(endpoints or {})))}")


def provider_of_endpoint(endpoint: ProviderEndpoint, *, script: Script = echo_script
                         ) -> ModelProvider:
    """The provider of one ``DSH_PROVIDERS`` endpoint, named after it in errors."""
    if endpoint.kind == "scripted":
        return ScriptedProvider(script, name=endpoint.name)
    if endpoint.kind == "deepseek":
        return DeepSeekProvider(endpoint.api_key, endpoint.base_url or DEEPSEEK_BASE_URL,
                                name=endpoint.name)
    return OpenAICompatibleProvider(endpoint.base_url, endpoint.api_key, name=endpoint.name)
