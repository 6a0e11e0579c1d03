"""The scheduling simulator (tests/bench/simulate.py) runs, and its policies behave sanely."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.bench import simulate
from tests.bench.simulate import GB, Shape, SimJob, Stream


def small_flood(seed: int) -> list[SimJob]:
    """A flood of small jobs on one 80 GB GPU, with a few big jobs arriving during it."""
    flood = (Stream((("upscale", 1.0),), 1.1, 0.0),)
    smalls, _ = simulate.generate(flood, random.Random(seed), jobs=300, capacity_mb=80 * GB)
    video = simulate.MODELS["video"]
    bigs = [
        SimJob(-1, "video", 10.0, video.vram_mb(10.0), video.run_s(10.0), priority, at)
        for at, priority in ((60.0, 0), (400.0, 10), (700.0, 0))
    ]
    jobs = sorted(smalls + bigs, key=lambda job: job.arrival_s)
    return [dataclasses.replace(job, id=index) for index, job in enumerate(jobs)]


def big_waits(policy: simulate.Policy, jobs: list[SimJob], shape: Shape) -> list[float]:
    """Each big job's wait under `policy`, by arrival."""
    runs = simulate.simulate(jobs, policy, shape)
    return [job.start_s - job.arrival_s for job in runs if job.size == "big"]


@pytest.mark.parametrize("name", list(simulate.WORKLOADS))
def test_every_policy_finishes_every_job(name: str) -> None:
    shape = Shape(hosts=1, gpus=2)
    jobs, _ = simulate.workload(name, seed=3, jobs=250, capacity_mb=shape.capacity_mb)
    outcomes = simulate.run_all(jobs, shape)
    assert [o.policy for o in outcomes] == ["fifo-slots", "fit-priority", "built"]
    bound = max(simulate.lower_bound(jobs, shape))
    for outcome in outcomes:
        assert outcome.finished == outcome.jobs == len(jobs)
        assert 0 < outcome.utilization <= 1
        assert outcome.makespan_s >= bound * (1 - 1e-9)
        assert all(wait[1] <= wait[2] <= wait[3] for wait in outcome.waits.values())


def test_several_hosts_share_one_queue() -> None:
    shape = Shape(hosts=2, gpus=1)
    jobs, _ = simulate.workload("mixed", seed=1, jobs=200, capacity_mb=shape.capacity_mb)
    for outcome in simulate.run_all(jobs, shape):
        assert outcome.finished == len(jobs)
        assert 0 < outcome.utilization <= 1


def test_reservations_stop_a_small_job_flood_from_starving_big_jobs() -> None:
    shape = Shape(hosts=1, gpus=1)
    for seed in (1, 2):
        jobs = small_flood(seed)
        fit = big_waits(simulate.FitPriority(), jobs, shape)
        built_policy = simulate.Built()
        built = big_waits(built_policy, jobs, shape)
        fifo = big_waits(simulate.FifoSlots(), jobs, shape)
        # Plain fit-filtering starts a big job only when the flood ebbs. The built policy holds the
        # GPU once it waited reserve_after_s (120 s) and the small jobs on it end (2-3 min at most).
        assert fit[0] > 1000 and built[0] < 300
        assert max(built) < max(fit) / 2
        assert max(built) < max(fifo)
        assert built_policy.reserved


def test_queue_orders_like_the_claim() -> None:
    queue = simulate.Queue(aging=True)
    old_low = SimJob(0, "upscale", 1.0, 2 * GB, 10.0, 0, arrival_s=0.0)
    big_high = SimJob(1, "video", 5.0, 50 * GB, 100.0, 10, arrival_s=500.0)
    new_high = SimJob(2, "upscale", 1.0, 2 * GB, 10.0, 10, arrival_s=590.0)
    for job in (old_low, big_high, new_high):
        queue.add(job)
    # At 600 s the old job has aged to 10, tying the new high one: the older wins. The big job
    # outranks both but fits no 40 GB budget, so it is the waiting head instead.
    assert queue.effective(old_low, 600.0) == 10
    assert queue.claim(600.0, 40 * GB) is old_low
    assert queue.waiting_head(600.0, 40 * GB, 80 * GB) is big_high
    assert queue.claim(600.0, 40 * GB, min_priority=11) is None
    assert queue.claim(600.0, 40 * GB, limits={"video": 99.0}) is None
    plain = simulate.Queue(aging=False)
    for job in (old_low, new_high):
        plain.add(job)
    assert plain.claim(600.0, 40 * GB) is new_high


def test_fifo_slots_take_each_models_declared_maximum() -> None:
    host = simulate.Host(0, (0,), 80 * GB, {0: 0})
    policy = simulate.FifoSlots()
    for index in range(12):
        policy.arrive(SimJob(index, "upscale", 1.0, 2 * GB, 10.0, 0, 0.0), 0.0)
    started = policy.fill(host, 0.0)
    # 8 GB slots in 80 GB less the 512 MB buffer: 9 jobs, though each needs only 2 GB.
    assert len(started) == 9 and policy.queued() == 3


def test_the_command_prints_tables(capsys: pytest.CaptureFixture[str]) -> None:
    simulate.main(["--jobs", "150", "--workload", "flood", "--markdown"])
    out = capsys.readouterr().out
    assert "#### flood, seed 1" in out and "| built |" in out
    simulate.main(["--jobs", "100", "--workload", "light", "--seeds", "2", "--gpus", "2"])
    assert "fit-priority" in capsys.readouterr().out
