"""A client of the processors workers' HTTP views (``dsh-pipeline processors``' web server).

Any worker answers for every session: faust forwards a per-session request to the worker
that owns its partition. httpx's errors are translated here, and only here, into
:class:`~pipeline.core.errors.TransportError`; a worker that answers that it cannot vouch
for an answer (503, its reason in the body) is not an error: :meth:`session_page` returns
None and the reason.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

from pipeline.adapters.urls import without_userinfo
from pipeline.core.errors import TransportError
from pipeline.core.events import JsonValue

TIMEOUT_S = 5.0


class ProcessorsWeb:
    """The views of the workers behind ``base_url`` (one client, closed by :meth:`close`)."""

    def __init__(self, base_url: str, *, timeout_s: float = TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.shown = without_userinfo(self.base_url, drop_query=True)   # for messages
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def close(self) -> None:
        await self._client.aclose()

    async def session_page(self, session_id: str
                           ) -> tuple[dict[str, JsonValue] | None, str]:
        """``GET /sessions/{id}/page``: where a session page starts, or None and the
        worker's reason when it cannot vouch for one (503)."""
        url = f"{self.base_url}/sessions/{quote(session_id, safe='')}/page"
        try:
            response = await self._client.get(url)
        except httpx.HTTPError as exc:
            raise TransportError(f"the processors at {self.shown} did not answer "
                                 f"({type(exc).__name__}: {exc})") from None
        if response.status_code == 503:
            return None, _reason(response)
        if response.status_code != 200:
            raise TransportError(f"the processors at {self.shown} answered "
                                 f"{response.status_code} for a session page: "
                                 f"{_reason(response)}")
        try:
            body: Any = response.json()
        except ValueError:
            raise TransportError(f"the processors at {self.shown} answered a session "
                                 "page that is not JSON") from None
        if not isinstance(body, dict):
            raise TransportError(f"the processors at {self.shown} answered a session "
                                 "page that is not a JSON object")
        return body, ""


def _reason(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    found = body.get("error") if isinstance(body, dict) else None
    return str(found)[:300] if found is not None else response.text[:300]
