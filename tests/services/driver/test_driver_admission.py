"""Step admission: how many sessions begin a step per transaction (``StepBudget``), in
arrival order, never leaving a runner stuck."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.services.driver.admission import StepBudget


async def _admit_all(admit: StepBudget, count: int, order: list[int]
                     ) -> list[asyncio.Task[None]]:
    async def one(index: int) -> None:
        await admit.admit()
        order.append(index)

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    await asyncio.sleep(0)  # every task has asked once
    return tasks


async def test_budget_admits_per_renewal_in_arrival_order() -> None:
    budget = StepBudget(3, stall_s=60, little_buffered=lambda: False)
    order: list[int] = []
    tasks = await _admit_all(budget, 8, order)
    for _ in range(3):
        await asyncio.sleep(0)
    assert order == [0, 1, 2]
    assert budget.queued == 5
    budget.renew()
    for _ in range(3):
        await asyncio.sleep(0)
    assert order == [0, 1, 2, 3, 4, 5]
    budget.renew()
    await asyncio.gather(*tasks)
    assert order == list(range(8))


async def test_budget_renews_itself_while_admitted_steps_buffer_little() -> None:
    """An admitted step waiting on a slow model must not hold the others back for good."""
    buffered: list[int] = []
    budget = StepBudget(1, stall_s=0.01, little_buffered=lambda: not buffered)
    order: list[int] = []
    tasks = await _admit_all(budget, 3, order)
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert order == [0, 1, 2]


async def test_budget_does_not_renew_itself_while_a_transaction_is_due() -> None:
    budget = StepBudget(1, stall_s=0.01, little_buffered=lambda: False)
    order: list[int] = []
    tasks = await _admit_all(budget, 2, order)
    await asyncio.sleep(0.1)
    assert order == [0]
    budget.renew()
    await asyncio.gather(*tasks)
    assert order == [0, 1]


async def test_opened_budget_releases_every_waiter_and_admits_from_then_on() -> None:
    budget = StepBudget(1, stall_s=60, little_buffered=lambda: False)
    order: list[int] = []
    tasks = await _admit_all(budget, 4, order)
    budget.open()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    await asyncio.wait_for(budget.admit(), 1)
    assert sorted(order) == [0, 1, 2, 3]


async def test_a_cancelled_waiter_does_not_use_up_the_budget() -> None:
    budget = StepBudget(1, stall_s=60, little_buffered=lambda: False)
    order: list[int] = []
    tasks = await _admit_all(budget, 3, order)
    tasks[1].cancel()
    budget.renew()
    await asyncio.gather(tasks[0], tasks[2])
    assert order == [0, 2]


@pytest.mark.parametrize("per", [0, -1])
def test_a_budget_below_one_is_refused(per: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        StepBudget(per, stall_s=1, little_buffered=lambda: True)
