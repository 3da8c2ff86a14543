"""Streaming ``POST {base}/chat/completions`` over httpx: DeepSeek and any OpenAI-compatible API.

This is the only module that meets httpx for model calls; every foreign failure is
translated here, in :func:`translate_http_error` and :func:`error_from_response`, into
:class:`ProviderError` with a code:

    401/403 AUTH   402 QUOTA   408 TIMEOUT   413 or 400 "context length" CONTEXT_WINDOW_EXCEEDED
    other 4xx BAD_REQUEST   429 RATE_LIMIT (+ retry_after_ms)   503/529 OVERLOADED
    other 5xx SERVER   connection failures NETWORK   idle/connect timeouts TIMEOUT
    malformed or truncated streams PROTOCOL   an empty answer EMPTY_RESPONSE

The adapter does not retry: the turn machine decides (``RetryPolicy``) and logs each retry.
The API key is sent as a bearer token only; it is never put in a message, a log line or a
repr, and any text echoed by the server is scrubbed of it before it reaches an error.

Consumers should close the stream with ``contextlib.aclosing`` (or ``aclose()``): closing
the iterator closes the HTTP response, which is how a cancelled turn stops the provider.
"""

from __future__ import annotations

import email.utils
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Any, Final

import httpx

from pipeline.adapters.llm.openai_messages import (
    DEEPSEEK_DIALECT,
    OPENAI_DIALECT,
    ChatDialect,
    build_chat_body,
)
from pipeline.adapters.llm.openai_stream import DONE, ChatStreamTranslator, SSEDecoder, excerpt
from pipeline.adapters.urls import without_userinfo
from pipeline.core.errors import ConfigError, ProviderError
from pipeline.core.model import Chunk, ModelRequest
from pipeline.core.rate_budget import RateSignal
from pipeline.settings import MASK, Secret

log = logging.getLogger(__name__)

NO_KEY: Final = Secret("")
DEEPSEEK_BASE_URL: Final = "https://api.deepseek.com"
REQUEST_ID_HEADERS: Final = ("x-request-id", "request-id", "x-ds-request-id", "cf-ray")
CONTEXT_WINDOW_PATTERN: Final = re.compile(
    r"context[ _-]?(length|window)|maximum context|too many tokens|prompt is too long|"
    r"reduce the length", re.IGNORECASE)
STATUS_CODES: Final = {401: "AUTH", 403: "AUTH", 402: "QUOTA", 408: "TIMEOUT", 413:
                       "CONTEXT_WINDOW_EXCEEDED", 429: "RATE_LIMIT", 503: "OVERLOADED",
                       529: "OVERLOADED"}
MAX_ERROR_BODY: Final = 64 * 1024


def parse_retry_after_ms(headers: Mapping[str, str], now: float) -> int | None:
    """``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date) in milliseconds."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            return max(0, round(float(raw_ms)))
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0, round(float(raw) * 1000))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0, round((when.timestamp() - now) * 1000))


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_reset_s(raw: str | None) -> float:
    """An ``x-ratelimit-reset-*`` value in seconds: ``1s``, ``6m0s``, ``20ms`` (OpenAI) or a
    plain number of seconds; 0 when absent or unreadable."""
    if not raw:
        return 0.0
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    parts = _DURATION_PART.findall(raw.strip())
    return sum(float(n) * _UNIT_S[unit] for n, unit in parts)


def rate_signal_of(headers: Mapping[str, str]) -> RateSignal | None:
    """The ``x-ratelimit-remaining-*`` / ``-reset-*`` headers, None when there are none."""
    def number(name: str) -> float | None:
        try:
            return float(headers[name])
        except (KeyError, ValueError):
            return None
    requests, tokens = (number("x-ratelimit-remaining-requests"),
                        number("x-ratelimit-remaining-tokens"))
    if requests is None and tokens is None:
        return None
    return RateSignal(requests, tokens, parse_reset_s(headers.get("x-ratelimit-reset-requests")),
                      parse_reset_s(headers.get("x-ratelimit-reset-tokens")))


def request_id_of(headers: Mapping[str, str]) -> str | None:
    for name in REQUEST_ID_HEADERS:
        value = headers.get(name)
        if value:
            return value
    return None


def _server_message(body: str) -> str:
    try:
        payload = json.loads(body)
    except ValueError:
        return excerpt(body.strip()) or "(empty body)"
    if isinstance(payload, Mapping):
        error = payload.get("error", payload)
        if isinstance(error, Mapping) and isinstance(error.get("message"), str):
            return excerpt(error["message"])
        if isinstance(error, str):
            return excerpt(error)
    return excerpt(body.strip())


def error_from_response(status: int, headers: Mapping[str, str], body: str, *,
                        provider: str, now: float) -> ProviderError:
    """The ProviderError for a non-200 answer (body already read, at most 64 KiB)."""
    message = _server_message(body)
    code = STATUS_CODES.get(status)
    if code is None:
        if status == 400 and CONTEXT_WINDOW_PATTERN.search(message):
            code = "CONTEXT_WINDOW_EXCEEDED"
        elif 400 <= status < 500:
            code = "BAD_REQUEST"
        elif status >= 500:
            code = "SERVER"
        else:
            code = "PROTOCOL"
    return ProviderError(f"{provider} answered HTTP {status} ({code}): {message}", code=code,
                         status=status, retry_after_ms=parse_retry_after_ms(headers, now),
                         request_id=request_id_of(headers))


def translate_http_error(exc: Exception, *, provider: str, url: str,
                         request_id: str | None = None) -> ProviderError:
    """The one place where httpx's exceptions become ProviderError."""
    kind = type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        what = "connecting" if isinstance(exc, httpx.ConnectTimeout) else "waiting for data"
        return ProviderError(f"{provider} timed out {what} ({kind}) at {url}", code="TIMEOUT",
                             request_id=request_id)
    if isinstance(exc, httpx.DecodingError | httpx.TooManyRedirects | httpx.LocalProtocolError):
        return ProviderError(f"{provider} sent a response that cannot be read ({kind}) at {url}",
                             code="PROTOCOL", request_id=request_id)
    if isinstance(exc, httpx.RemoteProtocolError):
        return ProviderError(f"{provider} closed the connection mid-response ({kind}) at {url}",
                             code="NETWORK", request_id=request_id)
    return ProviderError(f"{provider} could not be reached ({kind}) at {url}", code="NETWORK",
                         request_id=request_id)


def _replaced(error: ProviderError, *, message: str | None = None,
              request_id: str | None = None) -> ProviderError:
    return ProviderError(str(error) if message is None else message, code=error.code,
                         status=error.status, retry_after_ms=error.retry_after_ms,
                         request_id=error.request_id if request_id is None else request_id)


class OpenAICompatibleProvider:
    """Streams chat completions from any OpenAI-compatible endpoint (``base_url`` + key)."""

    def __init__(self, base_url: str, api_key: Secret = NO_KEY, *,
                 dialect: ChatDialect = OPENAI_DIALECT, idle_timeout_s: float = 120.0,
                 connect_timeout_s: float = 10.0, max_connections: int = 256,
                 trust_env: bool = True, name: str | None = None) -> None:
        """``idle_timeout_s``: the longest silence tolerated mid-stream (DeepSeek sends
        keep-alive comments while it thinks). ``trust_env``: honour HTTPS_PROXY/NO_PROXY.
        ``name``: what errors call the provider (default: the dialect's name)."""
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"provider base URL must start with http:// or https://, got "
                              f"{base_url!r}")
        self.name = name or dialect.name
        self._endpoint = base_url.rstrip("/") + "/chat/completions"
        self.url = without_userinfo(self._endpoint, marker="***@")  # messages and logs show it
        self._dialect = dialect
        self._api_key = api_key
        # pool=None: beyond max_connections a call waits for a free connection (backpressure)
        # instead of failing while other sessions stream for minutes.
        timeout = httpx.Timeout(connect=connect_timeout_s, read=idle_timeout_s, write=30.0,
                                pool=None)
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=trust_env)
        # Told each response's x-ratelimit-* headers (model, signal): the driver's budgets.
        self.on_rate_signal: Callable[[str, RateSignal], None] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, api_key={self._api_key!r})"

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key.reveal()}"
        return headers

    async def stream(self, request: ModelRequest) -> AsyncIterator[Chunk]:
        """The dsh chunks of one streamed answer; raises ProviderError on any failure."""
        body = build_chat_body(request, self._dialect)
        log.debug("POST %s model=%s messages=%d", self.url, request.model,
                  len(body["messages"]))
        try:
            async with aclosing(self._stream_body(body)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except ProviderError as exc:
            error = self._scrubbed(exc)
            log.info("%s call failed: code=%s status=%s request_id=%s", self.name, error.code,
                     error.status, error.request_id)
            raise error from None

    async def _stream_body(self, body: dict[str, Any]) -> AsyncGenerator[Chunk, None]:
        request_id: str | None = None
        try:
            async with self._client.stream("POST", self._endpoint, json=body,
                                           headers=self._headers()) as response:
                request_id = request_id_of(response.headers)
                signal = rate_signal_of(response.headers)
                if signal is not None and self.on_rate_signal is not None:
                    self.on_rate_signal(str(body.get("model", "")), signal)
                await self._check_status(response)
                async with aclosing(self._chunks(response, request_id)) as chunks:
                    async for chunk in chunks:
                        yield chunk
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise translate_http_error(exc, provider=self.name, url=self.url,
                                       request_id=request_id) from None
        except ProviderError as exc:
            if exc.request_id is not None or request_id is None:
                raise
            raise _replaced(exc, request_id=request_id) from None

    async def _check_status(self, response: httpx.Response) -> None:
        content_type = response.headers.get("content-type", "")
        if response.status_code == 200 and "text/event-stream" in content_type:
            return
        raw = b""
        async for piece in response.aiter_bytes():
            raw += piece
            if len(raw) >= MAX_ERROR_BODY:
                break
        body = raw.decode("utf-8", "replace")
        if response.status_code == 200:
            raise ProviderError(f"{self.name} answered {content_type or 'no content type'}"
                                f" instead of text/event-stream at {self.url}: "
                                f"{_server_message(body)}", code="PROTOCOL", status=200,
                                request_id=request_id_of(response.headers))
        raise error_from_response(response.status_code, response.headers, body,
                                  provider=self.name, now=time.time())

    async def _chunks(self, response: httpx.Response,
                      request_id: str | None) -> AsyncGenerator[Chunk, None]:
        translator = ChatStreamTranslator(request_id)
        decoder = SSEDecoder()
        async for line in response.aiter_lines():
            data = decoder.feed_line(line)
            if data is None:
                continue
            if data == DONE:
                break
            for chunk in translator.feed(data):
                yield chunk
        else:  # the body ended without [DONE]: a last event may lack its blank line
            data = decoder.flush()
            if data is not None and data != DONE:
                for chunk in translator.feed(data):
                    yield chunk
        for chunk in translator.end():
            yield chunk

    def _scrubbed(self, error: ProviderError) -> ProviderError:
        """The same error with the API key masked, in case the server echoed it."""
        key = self._api_key.reveal()
        text = str(error)
        if not key or key not in text:
            return error
        return _replaced(error, message=text.replace(key, MASK))

    async def aclose(self) -> None:
        await self._client.aclose()


class DeepSeekProvider(OpenAICompatibleProvider):
    """DeepSeek's API: thinking mode switch, ``reasoning_content`` passed back on tool turns."""

    def __init__(self, api_key: Secret, base_url: str = DEEPSEEK_BASE_URL, *,
                 idle_timeout_s: float = 120.0, connect_timeout_s: float = 10.0,
                 max_connections: int = 256, trust_env: bool = True,
                 name: str | None = None) -> None:
        if not api_key:
            raise ConfigError("the DeepSeek provider needs an API key: set DEEPSEEK_API_KEY "
                              "(or DSH_DEEPSEEK_API_KEY)")
        super().__init__(base_url, api_key, dialect=DEEPSEEK_DIALECT,
                         idle_timeout_s=idle_timeout_s, connect_timeout_s=connect_timeout_s,
                         max_connections=max_connections, trust_env=trust_env, name=name)
