"""The model provider interface the driver programs against."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from pipeline.core.model import Chunk, ModelRequest


@runtime_checkable
class ModelProvider(Protocol):
    """Streams one model answer per request as dsh chunks (see :mod:`pipeline.core.model`).

    ``stream`` returns an async iterator: a successful answer ends with block-ends, an
    optional usage and one finish (stop / tool-calls / max-tokens); a failure raises
    :class:`~pipeline.core.errors.ProviderError`, possibly after some chunks. Closing the
    iterator early (``aclose()``, ``contextlib.aclosing``) stops the call and frees its
    connection. Providers never retry on their own. ``aclose()`` releases the provider.
    """

    name: str

    def stream(self, request: ModelRequest) -> AsyncIterator[Chunk]: ...

    async def aclose(self) -> None: ...
