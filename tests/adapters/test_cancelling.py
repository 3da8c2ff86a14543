"""Stopping loops whose cancellation was lost inside a client call
(:mod:`pipeline.adapters.cancelling`; seen in CI: a dashboard stopped right after it started
waited for ever on loops back in their retry sleep)."""

from __future__ import annotations

import asyncio

from pipeline.adapters.cancelling import cancel_until_done
from pipeline.codec.avro import EventSerde
from pipeline.services.dashboard.service import DashboardService
from pipeline.settings import Settings


def _retrying_loop(rounds: list[str]) -> asyncio.Task[None]:
    async def loop() -> None:   # its client call lost the first cancellation, then it retries
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if rounds:
                    raise
                rounds.append("swallowed")
            await asyncio.sleep(0)
    return asyncio.create_task(loop())


async def test_a_loop_that_swallowed_its_cancellation_is_cancelled_again() -> None:
    rounds: list[str] = []
    failing = asyncio.create_task(asyncio.sleep(0, result=None))
    loop = _retrying_loop(rounds)
    await asyncio.sleep(0)
    ended = await asyncio.wait_for(cancel_until_done([loop, failing], recancel_s=0.05), 5)
    assert set(ended) == {loop, failing} and loop.cancelled() and rounds == ["swallowed"]


async def test_the_dashboards_stop_ends_such_a_loop() -> None:
    service = DashboardService(Settings.from_env({}), EventSerde().decode)
    rounds: list[str] = []
    service._tasks = [_retrying_loop(rounds)]
    await asyncio.sleep(0)
    await asyncio.wait_for(service.stop(), 10)
    assert rounds == ["swallowed"] and service._tasks == []
