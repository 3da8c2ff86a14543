"""The dashboard's stop ends its loops even when a cancellation is lost inside a client call
(CPython 3.11's ``wait_for``, used by aiokafka, can swallow one; seen in CI: the stop of a
dashboard started and stopped at once waited for ever on loops back in their retry sleep)."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.codec.avro import EventSerde
from pipeline.services.dashboard import service as dashboard_service
from pipeline.services.dashboard.service import DashboardService
from pipeline.settings import Settings


async def test_stop_cancels_again_a_loop_that_swallowed_its_cancellation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dashboard_service, "STOP_RECANCEL_S", 0.05)
    service = DashboardService(Settings.from_env({}), EventSerde().decode)
    rounds: list[str] = []

    async def retrying_loop() -> None:   # a client call that lost the first cancellation
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if rounds:
                    raise
                rounds.append("swallowed")
            await asyncio.sleep(0)

    service._tasks = [asyncio.create_task(retrying_loop(), name="dashboard-test")]
    await asyncio.sleep(0)
    await asyncio.wait_for(service.stop(), 5)
    assert rounds == ["swallowed"] and service._tasks == []
