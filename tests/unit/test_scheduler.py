"""The scheduling policy's pure functions (app/scheduler.py), on a simulated clock."""

from __future__ import annotations

import math

from app import scheduler
from app.scheduler import GpuRoom, Reservation, Running, RunTime, Waiting


def test_age_boost_is_bounded_and_steps():
    assert scheduler.age_boost(0, step_s=60, max_boost=10) == 0
    assert scheduler.age_boost(59, step_s=60, max_boost=10) == 0
    assert scheduler.age_boost(125, step_s=60, max_boost=10) == 2
    assert scheduler.age_boost(10**6, step_s=60, max_boost=10) == 10


def test_room_at_follows_expected_ends():
    gpu = GpuRoom(0, capacity_mb=80_000, available_mb=10_000)
    running = [Running(0, 30_000, 50.0), Running(0, 40_000, 20.0), Running(1, 70_000, 1.0)]
    assert scheduler.room_at(gpu, running, 5_000, now_s=0) == 0  # fits now
    assert scheduler.room_at(gpu, running, 45_000, now_s=0) == 20.0  # after the 40 GB job
    assert scheduler.room_at(gpu, running, 75_000, now_s=0) == 50.0  # after both
    assert scheduler.room_at(gpu, running, 90_000, now_s=0) is None  # never on this GPU


def test_reserve_waits_then_picks_the_gpu_that_frees_room_soonest():
    gpus = [GpuRoom(0, 80_000, 0), GpuRoom(1, 80_000, 0), GpuRoom(2, 24_000, 24_000)]
    running = [Running(0, 80_000, 300.0), Running(1, 60_000, 40.0), Running(1, 20_000, 90.0)]
    big = Waiting("big", 60_000, effective_priority=3, waited_s=10)
    assert scheduler.reserve(big, gpus, running, 0.0, after_s=120) is None  # not waited long enough
    late = Waiting("big", 60_000, effective_priority=3, waited_s=200)
    held = scheduler.reserve(late, gpus, running, 0.0, after_s=120)
    assert held == Reservation("big", 1, 60_000, 3, 40.0)  # GPU 2 is too small: never held for it


def test_split_budgets_holds_one_gpu_until_its_job_fits():
    reservation = Reservation("big", 1, 60_000, 0, 40.0)
    budgets = {0: 10_000, 1: 30_000}
    assert scheduler.split_budgets(budgets, None) == (budgets, {})
    assert scheduler.split_budgets(budgets, reservation) == ({0: 10_000}, {1: 30_000})
    assert scheduler.split_budgets({0: 10_000, 1: 70_000}, reservation) == ({0: 10_000, 1: 70_000}, {})


def test_backfill_only_what_ends_before_the_reserved_start():
    estimates = {"fast": RunTime(2.0, 1.0, 50), "slow": RunTime(600.0, 0.0, 50), "new": RunTime(1.0, 0.0, 2)}
    limits = scheduler.backfill_limits(estimates, ["fast", "slow", "new", "unknown"], 30.0, min_samples=5)
    assert set(limits) == {"fast"}  # slow runs too long; new and unknown have no history
    assert math.isclose(limits["fast"], (30 / 1.25 - 2.0) / 1.0)
    assert RunTime(1.0, 0.0, 9).max_megapixels(10.0) == math.inf
    assert RunTime(20.0, 1.0, 9).max_megapixels(10.0) == 0.0


def test_learned_vram_needs_samples_and_respects_the_cap():
    ratios = [0.5] * 18 + [0.6, 0.9]
    assert (
        scheduler.learned_vram_mb(4000, ratios[:5], percentile=95, margin_mb=100, min_samples=20, cap_mb=None)
        == 4000
    )
    learned = scheduler.learned_vram_mb(
        4000, ratios, percentile=95, margin_mb=100, min_samples=20, cap_mb=4000
    )
    assert learned == math.ceil(4000 * 0.6) + 100  # the 95th percentile of 20 samples is the 19th
    above = scheduler.learned_vram_mb(
        4000, [1.5] * 20, percentile=95, margin_mb=0, min_samples=20, cap_mb=4000
    )
    assert above == 4000  # never above the declared figure unless configured
    assert (
        scheduler.learned_vram_mb(4000, [1.5] * 20, percentile=95, margin_mb=0, min_samples=20, cap_mb=None)
        == 6000
    )


def test_after_oom_grows_to_at_least_the_peak_and_at_most_the_gpu():
    assert scheduler.after_oom_mb(4000, None, growth=1.5, capacity_mb=24_000) == 6000
    assert scheduler.after_oom_mb(4000, 7000, growth=1.5, capacity_mb=24_000) == 7001
    assert scheduler.after_oom_mb(20_000, None, growth=1.5, capacity_mb=24_000) == 24_000


def test_after_oom_with_an_endless_growth_is_the_whole_gpu():
    """GPUJOBS_OOM_GROWTH=inf (or 1e400) is accepted at start: the estimate became an infinite
    float, and rounding it up raised OverflowError instead of giving the whole GPU."""
    assert scheduler.after_oom_mb(4000, None, growth=math.inf, capacity_mb=24_000) == 24_000
    assert scheduler.after_oom_mb(4000, 9000, growth=1e308, capacity_mb=24_000) == 24_000


def test_a_stream_of_small_jobs_cannot_starve_a_big_one():
    """Simulated clock: with a reservation the big job starts once the held GPU drains."""
    now, gpu_mb, small_mb, big_mb = 0.0, 10_000, 3_000, 8_000
    running = [Running(0, small_mb, t) for t in (1.0, 2.0, 3.0)]
    waited = 0.0
    while True:
        free = gpu_mb - sum(r.vram_mb for r in running)
        room = GpuRoom(0, gpu_mb, free)
        waiting = Waiting("big", big_mb, 0, waited)
        held = scheduler.reserve(waiting, [room], running, now, after_s=5.0)
        open_, _ = scheduler.split_budgets({0: free}, held)
        if free >= big_mb:
            break  # the big job fits: the claim takes it (it is the oldest of equal priority)
        if open_.get(0, 0) >= small_mb:  # not held: a new small job takes the room
            running.append(Running(0, small_mb, now + 3.0))
        now = min(r.expected_end_s for r in running)
        running = [r for r in running if r.expected_end_s > now]
        waited = now
        assert now < 60, "the big job starved"
    assert 5.0 <= now <= 5.0 + 3.0  # it waited the reservation time plus at most one small run
