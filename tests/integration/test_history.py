"""Statements that read finished jobs cost the same beside 20,000 of them as beside none: each
reads its recent rows through an index, never the whole table (migration 0005)."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from app.queue import sql
from app.queue.manager import JobManager
from tests import plans
from tests.integration.test_worker import enqueue

HISTORY = 20_000


@pytest.fixture
async def history(manager: JobManager, engine) -> None:
    """One queued job of model `toy` and 20,000 succeeded copies of it, finished a second apart
    going back from now (each waited a second and ran a second), each with a recorded peak equal
    to its estimate."""
    await enqueue(manager)
    async with engine.begin() as conn:
        await conn.execute(plans.FINISHED_BESIDE, {"count": HISTORY})
        await conn.execute(text("ANALYZE jobs"))


@pytest.mark.parametrize(
    ("name", "values"),
    [("RUN_TIMES", {}), ("VRAM_RATIOS", {}), ("FINISHED_STATS", {"window_s": 60, "recent_s": 30})],
)
async def test_reads_of_recent_history_use_an_index(history, engine, name: str, values: dict[str, float]):
    plan = await plans.explained(engine, getattr(sql, name), values)
    assert "Seq Scan" not in plans.scans_of(plan, "jobs"), plan
    assert plans.rows_read(plan, "jobs") <= 5_000, plan


async def test_recent_history_is_read_right(history, manager: JobManager, engine):
    samples, mean_s, _, _ = (await manager.reports.run_times())["toy"]
    assert samples == 5_000 and mean_s > 0  # the newest 5,000 successes
    ratios, peak_mb = (await manager.reports.vram_ratios())["toy"]
    assert len(ratios) == 5_000 and set(ratios) == {1.0} and peak_mb == 1000
    # The copies finished a second apart: the windows hold fewer of them as the test's time passes.
    before = await finished_within(engine, 60), await finished_within(engine, 30)
    stats = await manager.reports.finished_stats(window_s=60, recent_s=30)
    after = await finished_within(engine, 60), await finished_within(engine, 30)
    assert after[0] <= stats.finished <= before[0] and after[1] <= stats.recent <= before[1], (before, after)
    assert stats.finished >= 30 and stats.succeeded == stats.finished
    assert stats.wait_s == (1.0, 1.0) and stats.run_s == (1.0, 1.0)  # each waited 1 s, ran 1 s


async def finished_within(engine, seconds: int) -> int:
    query = text("SELECT count(*) FROM jobs WHERE finished_at > now() - make_interval(secs => :s)")
    async with engine.connect() as conn:
        return int(await conn.scalar(query, {"s": seconds}))
