"""The dashboard in a background thread, for commands that run their own event loops
(``dsh-pipeline demo``): ``with BackgroundDashboard(settings, decode) as url: ...``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from types import TracebackType

from pipeline.adapters.kafka.event_stream import Decoder
from pipeline.core.errors import ConfigError
from pipeline.services.dashboard.server import RunningDashboard, start_dashboard
from pipeline.settings import Settings

START_TIMEOUT_S = 30.0


class BackgroundDashboard:
    """Serves on the configured port (a free one if it is taken) until the block ends."""

    def __init__(self, settings: Settings, decode: Decoder) -> None:
        self._settings = settings
        self._decode = decode
        self._url: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="dashboard", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        return self._url.result(START_TIMEOUT_S)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(START_TIMEOUT_S)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to the caller waiting in __enter__
            if not self._url.done():
                self._url.set_exception(exc)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        running = await self._start()
        self._url.set_result(running.url)
        try:
            await self._stop.wait()
        finally:
            await running.stop()

    async def _start(self) -> RunningDashboard:
        try:
            return await start_dashboard(self._settings, self._decode)
        except ConfigError:  # the configured port is taken: any free one will do
            return await start_dashboard(self._settings, self._decode, port=0)
