"""Listing every caller's jobs (an admin key, the web UI's jobs and admin pages) reads one page of
rows through an index, however many finished jobs the history keeps (migration 0007)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from sqlalchemy import event, text

from app.queue.jobs import JobState
from app.queue.manager import JobManager
from tests import plans

HISTORY = 6_000

# Finished jobs of six owners over two models, newest first; one in 100 quarantined, one in 50
# failed, and one in 50 of a rarely used model.
FINISHED = text(
    """
    INSERT INTO jobs (owner, model, megapixels, vram_mb, declared_vram_mb, max_attempts, attempt,
                      state, created_at, started_at, finished_at)
    SELECT 'owner-' || g % 6, CASE WHEN g % 50 = 1 THEN 'rare' ELSE 'toy' END, 0.3, 1000, 1000, 1, 1,
           CAST(CASE WHEN g % 100 = 0 THEN 'quarantined' WHEN g % 50 = 0 THEN 'failed'
                     ELSE 'succeeded' END AS job_state),
           now() - g * interval '1 minute', now() - g * interval '1 minute',
           now() - g * interval '1 minute' + interval '10 seconds'
    FROM generate_series(1, :count) AS g
    """
)


@pytest.fixture
async def history(engine: Any) -> None:
    """HISTORY finished jobs, analyzed."""
    async with engine.begin() as conn:
        await conn.execute(FINISHED, {"count": HISTORY})
        await conn.execute(text("ANALYZE jobs"))


async def list_plan(manager: JobManager, engine: Any, **filters: Any) -> dict[str, Any]:
    """The plan of the statement `manager.listing.page(**filters)` sends, run again under EXPLAIN
    ANALYZE with its own parameters (sequential scans off: a table this small could be read
    whole for less, a history of a million jobs could not)."""
    sent: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            sent.append((statement, parameters))

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        page = await manager.listing.page(limit=50, **filters)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)
    assert len(page.jobs) == 50
    [(statement, parameters)] = sent
    async with engine.connect() as conn:
        await conn.execute(text("SET enable_seqscan = off"))
        result = await conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", parameters)
        plan = result.scalar()
        await conn.rollback()
    return plan[0]["Plan"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "filters",
    [
        {},
        {"state": JobState.failed},
        {"state": JobState.quarantined},
        {"model": "rare"},
    ],
    ids=["all", "failed", "quarantined", "rare-model"],
)
async def test_a_page_of_everyones_jobs_reads_about_one_page_of_rows(
    manager: JobManager, engine: Any, history: None, filters: dict[str, Any]
) -> None:
    """Without an index in the list's order the newest 51 of all jobs (or of all failed ones) were
    found by reading every job and sorting: 330 ms for an admin's GET /jobs beside 1,000,000
    finished jobs, 100 ms for each of the failed and quarantined lists that the admin page reloads
    while open (tests/bench/README.md, "Scale")."""
    plan = await list_plan(manager, engine, **filters)
    assert "Seq Scan" not in plans.scans_of(plan, "jobs"), plan
    assert "Sort" not in {n["Node Type"] for n in plans.nodes(plan)}, plan  # read in order
    assert plans.rows_read(plan, "jobs") <= 51 * 2, plan


@pytest.mark.parametrize("owner", [None, "owner-1"], ids=["everyone", "one-owner"])
async def test_a_page_deep_in_the_history_reads_about_one_page_of_rows(
    manager: JobManager, engine: Any, history: None, owner: str | None
) -> None:
    """The cursor's condition was `created_at < t OR (created_at = t AND id < i)`, which no index
    reads in order from the cursor: every older job was read and sorted (900,000 deep beside a
    million finished jobs: 200 ms for 51 rows). As a row comparison the index starts at the cursor."""
    async with engine.connect() as conn:
        deep = (
            await conn.execute(
                text(
                    "SELECT created_at, id FROM jobs WHERE CAST(:owner AS text) IS NULL OR owner = :owner"
                    " ORDER BY created_at DESC, id DESC OFFSET :depth LIMIT 1"
                ),
                {"owner": owner, "depth": HISTORY // 12 if owner else HISTORY // 2},  # half-way down
            )
        ).one()
    cursor = base64.urlsafe_b64encode(f"{deep.created_at.isoformat()}|{deep.id}".encode()).decode()
    plan = await list_plan(manager, engine, owner=owner, cursor=cursor)
    assert "Seq Scan" not in plans.scans_of(plan, "jobs"), plan
    assert "Sort" not in {n["Node Type"] for n in plans.nodes(plan)}, plan  # read in order
    bounds = [n.get("Index Cond", "") for n in plans.nodes(plan)]
    assert any("ROW(created_at, id) <" in cond for cond in bounds), plan  # the index starts at the cursor
    if owner is None:  # (one owner's sixth of this small table is read through the same index, filtered)
        assert plans.rows_read(plan, "jobs") <= 51 * 2, plan
