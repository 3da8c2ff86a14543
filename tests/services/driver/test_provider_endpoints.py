"""``DSH_PROVIDERS`` (named endpoints) and ``DSH_PROVIDER_FALLBACKS`` as the driver reads them.

Each endpoint's key comes from the variable its ``apiKeyEnv`` names, never from the setting,
and is masked wherever printed; a wrong entry stops the driver at start with an error naming
it (never a key's value); without the settings the driver is what it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.adapters.llm import DeepSeekProvider, OpenAICompatibleProvider, ScriptedProvider
from pipeline.adapters.llm.endpoints import ProviderEndpoint, parse_providers
from pipeline.adapters.llm.factory import provider_from_settings
from pipeline.cli.cmd_driver import driver_context
from pipeline.cli.provider_config import fallbacks_of, provider_endpoints_of
from pipeline.core.errors import ConfigError
from pipeline.core.provider_routes import Route
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import MASK, Settings

KEY = "sk-never-printed-57721"
ENV = {"BACKUP_API_KEY": KEY}
PROVIDERS = {"backup": {"kind": "openai-compatible", "baseURL": "http://127.0.0.1:9/v1",
                        "apiKeyEnv": "BACKUP_API_KEY"},
             "ds": {"kind": "deepseek", "apiKeyEnv": "BACKUP_API_KEY"},
             "demo": {"kind": "scripted"}}


def test_endpoints_read_their_keys_from_the_named_variables_and_mask_them() -> None:
    endpoints = parse_providers(PROVIDERS, ENV)
    backup = endpoints["backup"]
    assert (backup.kind, backup.base_url, backup.api_key_env) == (
        "openai-compatible", "http://127.0.0.1:9/v1", "BACKUP_API_KEY")
    assert backup.api_key.reveal() == KEY
    assert KEY not in repr(endpoints) and MASK in repr(backup)
    assert endpoints["demo"].api_key.reveal() == ""


async def test_each_endpoint_becomes_a_provider_named_after_it() -> None:
    endpoints = parse_providers(PROVIDERS, ENV)
    made = {name: provider_from_settings(Settings(), name, endpoints=endpoints)
            for name in ("backup", "ds", "demo", "scripted")}
    try:
        assert isinstance(made["backup"], OpenAICompatibleProvider)
        assert made["backup"].url == "http://127.0.0.1:9/v1/chat/completions"
        assert isinstance(made["ds"], DeepSeekProvider)
        assert made["ds"].url == "https://api.deepseek.com/chat/completions"
        assert isinstance(made["demo"], ScriptedProvider)
        assert {name: p.name for name, p in made.items()} == {
            "backup": "backup", "ds": "ds", "demo": "demo", "scripted": "scripted"}
        assert KEY not in repr(made["backup"])
    finally:
        for provider in made.values():
            await provider.aclose()
    with pytest.raises(ConfigError, match=r"unknown model provider 'nope'.*backup"):
        provider_from_settings(Settings(), "nope", endpoints=endpoints)


@pytest.mark.parametrize(("entry", "names"), [
    ({"kind": "openai-compatible", "baseURL": "http://x", "apiKey": KEY},
     "DSH_PROVIDERS['p'] holds an apiKey"),
    ({"kind": "openai-compatible", "baseUrl": "http://x"}, "unknown field(s) baseUrl (spelled "
                                                          "baseURL)"),
    ({"kind": "anthropic"}, "DSH_PROVIDERS['p'].kind must be one of"),
    ({"kind": "openai-compatible"}, "DSH_PROVIDERS['p'] (openai-compatible) needs a baseURL"),
    ({"kind": "openai-compatible", "baseURL": "ftp://x"}, "baseURL must start with http"),
    ({"kind": "deepseek"}, "DSH_PROVIDERS['p'] (deepseek) needs apiKeyEnv"),
    ({"kind": "deepseek", "apiKeyEnv": "UNSET_KEY"}, "apiKeyEnv names UNSET_KEY, which is not "
                                                     "set"),
    ("deepseek", "DSH_PROVIDERS['p'] must be an object"),
])
def test_a_wrong_endpoint_is_named_and_no_key_is_shown(entry: object, names: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_providers({"p": entry}, ENV)
    assert names in str(caught.value)
    assert KEY not in str(caught.value)


def test_a_provider_name_cannot_hold_a_slash() -> None:
    with pytest.raises(ConfigError, match="DSH_PROVIDERS\\['a/b'\\]: a provider name"):
        parse_providers({"a/b": {"kind": "scripted"}}, {})


def test_the_settings_hold_json_or_a_file_path(tmp_path: Path) -> None:
    path = tmp_path / "providers.json"
    path.write_text(json.dumps(PROVIDERS), encoding="utf-8")
    for value in (json.dumps(PROVIDERS), str(path)):
        endpoints = provider_endpoints_of(Settings(providers=value), ENV)
        assert set(endpoints) == {"backup", "ds", "demo"}
    assert provider_endpoints_of(Settings(), {}) == {}
    with pytest.raises(ConfigError, match=r"DSH_PROVIDERS file .* cannot be read"):
        provider_endpoints_of(Settings(providers=str(tmp_path / "missing.json")), ENV)
    with pytest.raises(ConfigError, match="DSH_PROVIDER_FALLBACKS is not JSON"):
        fallbacks_of(Settings(provider_fallbacks="{nope"), {})


def test_fallbacks_may_name_built_in_providers_and_endpoints_only() -> None:
    endpoints: dict[str, ProviderEndpoint] = parse_providers(PROVIDERS, ENV)
    fallbacks = fallbacks_of(Settings(provider_fallbacks=json.dumps(
        {"deepseek/deepseek-chat": ["backup/gpt-4o-mini", "openai/gpt-4o"]})), endpoints)
    assert fallbacks is not None
    assert fallbacks.chain(Route("deepseek", "deepseek-chat"))[1:] == (
        Route("backup", "gpt-4o-mini"), Route("openai", "gpt-4o"))
    assert fallbacks_of(Settings(), endpoints) is None
    with pytest.raises(ConfigError, match="unknown provider\\(s\\) 'backup'"):
        fallbacks_of(Settings(provider_fallbacks='{"deepseek/x": ["backup/y"]}'), {})


def test_a_driver_with_a_wrong_fallback_does_not_start() -> None:
    settings = Settings(providers=json.dumps(PROVIDERS),
                        provider_fallbacks='{"backup/x": ["typo/y"]}')
    with pytest.raises(ConfigError, match="DSH_PROVIDER_FALLBACKS names unknown provider"):
        driver_context(settings, group_id="g", tools=builtin_registry(), env=ENV)
    good = Settings(providers=json.dumps(PROVIDERS),
                    provider_fallbacks='{"backup/x": ["demo/y"]}')
    assert driver_context(good, group_id="g", tools=builtin_registry(), env=ENV) is not None
