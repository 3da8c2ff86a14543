"""The dashboard over HTTPS when given a certificate: the token still guards every page but
/health, a client trusting the CA gets the pages, and plain HTTP on that port is refused."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from pipeline.adapters.secure.tls import make_pki
from pipeline.codec.avro import EventSerde
from pipeline.core.errors import ConfigError
from pipeline.services.dashboard.server import start_dashboard
from pipeline.settings import Secret, Settings

TOKEN = "tls-test-token-8c1f"


def _settings(kafka_bootstrap: str, topic_prefix: str, tmp_path: Path,
              **changes: object) -> Settings:
    pki = make_pki(tmp_path / "tls")
    base = Settings.from_env({}, bootstrap_servers=kafka_bootstrap, topic_prefix=topic_prefix,
                             partitions=3, dashboard_token=Secret(TOKEN),
                             dashboard_tls_cert=str(pki.cert_file),
                             dashboard_tls_key=str(pki.key_file))
    return Settings.from_env(base.to_env(), **changes)


async def test_https_with_the_token_and_plain_http_refused(
        kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> None:
    settings = _settings(kafka_bootstrap, topic_prefix, tmp_path)
    dashboard = await start_dashboard(settings, EventSerde().decode, host="127.0.0.1", port=0)
    try:
        assert dashboard.url.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=str(tmp_path / "tls" / "ca.pem"))
        async with httpx.AsyncClient(verify=trust, timeout=10) as https:
            assert (await https.get(dashboard.url + "health")).status_code == 200
            assert (await https.get(dashboard.url + "api/fleet")).status_code == 401
            page = await https.get(dashboard.url + "api/fleet",
                                   headers={"Authorization": f"Bearer {TOKEN}"})
            assert page.status_code == 200
        async with httpx.AsyncClient(timeout=10) as untrusting:
            with pytest.raises(httpx.ConnectError):
                await untrusting.get(dashboard.url + "health")
        plain = dashboard.url.replace("https://", "http://")
        async with httpx.AsyncClient(timeout=10) as http:
            with pytest.raises(httpx.HTTPError):
                await http.get(plain + "api/fleet", headers={"Authorization": f"Bearer {TOKEN}"})
    finally:
        await dashboard.stop()


async def test_a_certificate_without_its_key_is_a_clear_error(
        kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> None:
    settings = _settings(kafka_bootstrap, topic_prefix, tmp_path, dashboard_tls_key="")
    with pytest.raises(ConfigError, match="DSH_DASHBOARD_TLS_KEY"):
        await start_dashboard(settings, EventSerde().decode, host="127.0.0.1", port=0)
