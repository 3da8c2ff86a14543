"""Small pure helpers of the turn machine: failures and request comparison."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.core.errors import ProviderError
from pipeline.core.events import JsonValue
from pipeline.core.model import ModelRequest

_HEADER_FIELDS = ("provider", "model", "system", "tools", "reasoning_effort", "max_tokens")


def error_reason(message: str, code: str) -> dict[str, JsonValue]:
    """A ``turn/end`` error reason the driver itself decides (not a provider's)."""
    return {"kind": "error", "error": {"message": message, "code": code}}


def stream_error(finish: Mapping[str, Any] | None) -> ProviderError:
    """The failure a stream reported in its own error finish, or the lack of a finish."""
    if finish is not None and finish.get("kind") == "error":
        failure = finish.get("failure") or {}
        return ProviderError(str(failure.get("message", "provider error")),
                             code=str(failure.get("code", "UNKNOWN")),
                             status=failure.get("status"),
                             retry_after_ms=failure.get("providerRetryAfterMs"),
                             request_id=failure.get("requestId"))
    if finish is not None:  # aborted, or a kind this driver does not know
        return ProviderError(f"the stream finished with {finish.get('kind')!r}",
                             code="ABORTED" if finish.get("kind") == "aborted" else "UNKNOWN")
    return ProviderError("the stream ended without a finish chunk", code="EMPTY_RESPONSE")


def request_diff(expected: ModelRequest, actual: ModelRequest) -> list[str]:
    """Names of the parts that differ (never their content: it may be large or private)."""
    parts = [name for name in _HEADER_FIELDS if getattr(expected, name) != getattr(actual, name)]
    if expected.messages != actual.messages:
        first = next((i for i, (a, b) in enumerate(zip(expected.messages, actual.messages,
                                                       strict=False)) if a != b),
                     min(len(expected.messages), len(actual.messages)))
        parts.append(f"messages (log derives {len(expected.messages)}, request has "
                     f"{len(actual.messages)}, first difference at index {first})")
    return parts or ["an unnamed field"]
