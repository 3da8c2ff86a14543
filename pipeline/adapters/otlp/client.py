"""The OTLP/HTTP exporter: POST ``{endpoint}/v1/traces`` (protobuf), with the protocol's
retry rules.

- 2xx: accepted (a ``partial_success`` says how many spans the receiver dropped anyway);
- 429, 502, 503, 504, and a connection that fails or times out: retried, without end, with
  exponential backoff (capped), waiting at least what ``Retry-After`` asks (seconds or an
  HTTP date). A collector that is down means the caller waits, never that spans are lost;
- 400 (bad data) and 413 (too large): the receiver refuses the data: :class:`OtlpRejected`
  (the caller sends smaller requests, and dead-letters what is still refused);
- any other status (401, 403, 404, other 5xx...) is a configuration error the
  protocol says not to retry: :class:`OtlpFailed`, which stops the caller without
  committing anything.

Headers (``DSH_OTLP_HEADERS``: ``name=value`` pairs separated by commas, values
percent-decoded, as ``OTEL_EXPORTER_OTLP_HEADERS``) carry credentials: they are never
logged or put in an error message.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote

import httpx

from pipeline.adapters.otlp.encode import CONTENT_TYPE, rejected_spans
from pipeline.adapters.urls import without_userinfo
from pipeline.core.errors import ConfigError, DshError

log = logging.getLogger(__name__)

RETRYABLE: Final = frozenset({429, 502, 503, 504})
TRACES_PATH: Final = "/v1/traces"


class OtlpRejected(DshError):
    """The receiver refused the request's data (HTTP 400, or 413 for its size): retrying
    the same request cannot help."""


class OtlpFailed(DshError):
    """The receiver answered a status that is neither success, retryable nor 400."""


def parse_headers(text: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` (values percent-encoded) as a dict; a malformed pair is a ConfigError
    that names its position, never its value."""
    headers: dict[str, str] = {}
    for index, pair in enumerate(p for p in text.split(",") if p.strip()):
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"DSH_OTLP_HEADERS: pair {index + 1} is not name=value")
        headers[name.strip()] = unquote(value.strip())
    return headers


def retry_after_s(value: str | None, now: float) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delta seconds or HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now)


@dataclass(slots=True)
class ExportStats:
    requests: int = 0
    retries: int = 0
    rejected_spans: int = 0
    last_error: str = ""


class OtlpHttpExporter:
    """Posts serialized trace requests; :meth:`export` returns once one is acknowledged."""

    def __init__(self, endpoint: str, headers: Mapping[str, str] | None = None, *,
                 timeout_s: float = 10.0, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 on_retry: Callable[[str], None] | None = None) -> None:
        self.url = endpoint.rstrip("/") + TRACES_PATH
        self.display_url = without_userinfo(self.url)  # what logs and errors name
        self._client = httpx.AsyncClient(
            headers={**(headers or {}), "Content-Type": CONTENT_TYPE}, timeout=timeout_s)
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._sleep = sleep
        self._on_retry = on_retry
        self.stats = ExportStats()
        self._last_body = b""

    async def close(self) -> None:
        await self._client.aclose()

    async def export(self, body: bytes) -> int:
        """Post ``body`` until acknowledged; returns the spans the receiver said it rejected.

        Raises :class:`OtlpRejected` on 400 and 413, :class:`OtlpFailed` on other final
        statuses.
        """
        attempt = 0
        while True:
            self.stats.requests += 1
            wait = await self._attempt(body)
            if wait is None:
                return self._accepted()
            attempt += 1
            self.stats.retries += 1
            backoff = min(self._max_backoff_s, self._backoff_s * 2 ** min(attempt - 1, 16))
            delay = max(wait, backoff * (0.5 + random.random() / 2))
            if self._on_retry is not None:
                self._on_retry(self.stats.last_error)
            if attempt == 1 or attempt % 10 == 0:
                log.warning("OTLP export to %s: %s; retry %d in %.1fs", self.display_url,
                            self.stats.last_error, attempt, delay)
            await self._sleep(delay)

    async def _attempt(self, body: bytes) -> float | None:
        """None when acknowledged, else the least wait before the next attempt."""
        try:
            response = await self._client.post(self.url, content=body)
        except httpx.HTTPError as exc:  # connection refused, reset, timeout: the collector
            self.stats.last_error = f"{type(exc).__name__}"  # is away; its text may hold
            return 0.0                                          # the URL only, still: no text
        status = response.status_code
        if 200 <= status < 300:
            self._last_body = response.content
            return None
        reason = _reason(response)
        self.stats.last_error = f"HTTP {status}{': ' + reason if reason else ''}"
        if status in RETRYABLE:
            return retry_after_s(response.headers.get("Retry-After"), time.time()) or 0.0
        if status in (400, 413):
            raise OtlpRejected(f"the OTLP receiver refused the spans (HTTP {status}): "
                               f"{reason}")
        raise OtlpFailed(f"the OTLP receiver at {self.display_url} answered HTTP {status}"
                         f"{': ' + reason if reason else ''}; not retried (check the "
                         "endpoint and DSH_OTLP_HEADERS)")

    def _accepted(self) -> int:
        count, message = rejected_spans(self._last_body)
        if count:
            self.stats.rejected_spans += count
            log.warning("OTLP receiver accepted the request but rejected %d span(s): %s",
                        count, message[:200])
        return count


def _reason(response: httpx.Response) -> str:
    """A short printable reason from an error response (a protobuf Status or text)."""
    text = response.content[:300].decode("utf-8", "replace")
    printable = "".join(c for c in text if c.isprintable())
    return printable.strip()[:200]
