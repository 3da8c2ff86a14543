"""The driver's collector policy: thresholds raised and restored, freezes, nesting."""

from __future__ import annotations

import gc

from pipeline.services.driver.gc_tuning import YOUNG_THRESHOLD, DriverGc, driver_gc


def test_driver_gc_raises_the_young_threshold_and_restores_it() -> None:
    before = gc.get_threshold()
    with driver_gc():
        assert gc.get_threshold()[0] == max(YOUNG_THRESHOLD, before[0])
        assert gc.get_threshold()[1:] == before[1:]
    assert gc.get_threshold() == before


def test_objects_live_at_a_freeze_are_left_out_until_the_policy_ends() -> None:
    with driver_gc() as policy:
        kept = [{"seq": n} for n in range(1000)]  # a rebuilt log, say
        policy.freeze()
        assert gc.get_freeze_count() >= len(kept)
        policy.release()  # a partition was given up: everything is collectable again
        assert gc.get_freeze_count() == 0
        policy.freeze()
    assert gc.get_freeze_count() == 0
    assert kept[999] == {"seq": 999}


def test_nested_policies_restore_the_outer_thresholds_once() -> None:
    before = gc.get_threshold()
    with driver_gc(young_threshold=5000):
        with driver_gc(young_threshold=50_000):
            assert gc.get_threshold()[0] == max(5000, before[0])
        assert gc.get_threshold()[0] == max(5000, before[0])
    assert gc.get_threshold() == before


def test_tick_freezes_only_when_the_last_freeze_is_old_enough() -> None:
    now = [100.0]
    policy = DriverGc(freeze_every_s=60.0, clock=lambda: now[0])
    try:
        policy.tick()
        assert policy.freezes == 0
        now[0] += 61.0
        policy.tick()
        assert policy.freezes == 1
        policy.tick()
        assert policy.freezes == 1
    finally:
        gc.unfreeze()
