"""Retention's statements read `jobs` and `inputs` through their indexes, at sizes where the
planner, left to guess, read whole tables (a prune runs them for every batch of 500 jobs)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import text

from app.queue import sql
from tests import plans

HISTORY = 20_000
BATCH = 500

# One finished job a minute, each with an image of its own; those that finished more than eight
# days ago were expired by earlier runs (their images detached and deleted), as a service that
# prunes keeps them. A cutoff of seven days then finds a day's worth of jobs to expire.
FILL = (
    """
    INSERT INTO inputs (sha256, media_type, width, height, bytes, data)
    SELECT md5(g::text), 'image/png', 1, 1, 1, '\\x00'::bytea FROM generate_series(1, 8 * 1440) AS g
    """,
    """
    INSERT INTO jobs (owner, model, input_id, megapixels, vram_mb, declared_vram_mb, max_attempts,
                      attempt, state, created_at, started_at, finished_at, expired_at)
    SELECT 'owner-' || g % 6, 'toy',
           CASE WHEN g <= 8 * 1440 THEN (SELECT min(id) FROM inputs) + g - 1 END, 0.3, 1000, 1000, 1, 1,
           CAST(CASE WHEN g % 50 = 0 THEN 'failed' ELSE 'succeeded' END AS job_state),
           now() - g * interval '1 minute', now() - g * interval '1 minute',
           now() - g * interval '1 minute' + interval '10 seconds',
           CASE WHEN g > 8 * 1440 THEN now() - g * interval '1 minute' + interval '8 days' END
    FROM generate_series(1, :count) AS g
    """,
    "ANALYZE jobs",
    "ANALYZE inputs",
)

# Detach the images of :ids from their jobs; the images' ids.
DETACH = text(
    """
    WITH old AS (SELECT id, input_id FROM jobs WHERE id = ANY(:ids) AND input_id IS NOT NULL)
    UPDATE jobs AS j SET input_id = NULL FROM old WHERE j.id = old.id RETURNING old.input_id
    """
)

MODES = ("force_custom_plan", "force_generic_plan")  # a prepared statement may go generic


@pytest.fixture
async def history(engine: Any) -> datetime:
    """HISTORY finished jobs, analyzed; the cutoff of a prune that keeps seven days."""
    async with engine.begin() as conn:
        for statement in FILL:
            await conn.execute(text(statement), {"count": HISTORY})
        return await conn.scalar(text("SELECT now() - interval '7 days'"))  # type: ignore[no-any-return]


async def read_by_index(engine: Any, statement: Any, values: dict[str, Any], *, most: int) -> None:
    """`statement`, under custom and generic plans, reads no table whole and at most `most` rows
    of `jobs` and of `inputs`."""
    for mode in MODES:
        [plan] = await plans.prepared_plans(engine, statement, values, mode)
        for table in ("jobs", "inputs"):
            assert "Seq Scan" not in plans.scans_of(plan, table), (mode, table, plan)
            assert plans.rows_read(plan, table) <= most, (mode, table, plan)


async def test_a_prune_batch_reads_its_jobs_and_images_by_index(engine: Any, history: datetime) -> None:
    """EXPIRE took its batch through ix_jobs_retention, then updated it through a hash join that
    read all 20,000 jobs (32 ms a batch on PostgreSQL 15, 23 ms by key; the planner chose the key
    itself at 100,000). The statements after it, given the batch's ids, read every unexpired job,
    or every image, for their 500."""
    cutoff = history
    await read_by_index(engine, sql.EXPIRABLE, {"cutoff": cutoff, "limit": BATCH}, most=BATCH)
    await read_by_index(engine, sql.EXPIRABLE, {"cutoff": cutoff, "limit": 1_000_000}, most=2 * 1440)
    await read_by_index(engine, sql.EXPIRE, {"cutoff": cutoff, "limit": BATCH}, most=2 * BATCH)

    async with engine.begin() as conn:  # the batch expired, as EXPIRE leaves it
        ids = [r.id for r in (await conn.execute(sql.EXPIRABLE, {"cutoff": cutoff, "limit": BATCH})).all()]
        await conn.execute(text("UPDATE jobs SET expired_at = now() WHERE id = ANY(:ids)"), {"ids": ids})
    await read_by_index(engine, sql.LOCK_INPUTS, {"ids": ids}, most=2 * BATCH)
    await read_by_index(engine, sql.DETACH_UNUSED_INPUTS, {"ids": ids}, most=3 * BATCH)

    async with engine.begin() as conn:  # their images detached, as DETACH_UNUSED_INPUTS leaves them
        inputs = list((await conn.execute(DETACH, {"ids": ids})).scalars())
    assert len(inputs) == BATCH
    await read_by_index(engine, sql.DELETE_INPUTS, {"ids": inputs}, most=2 * BATCH)


async def test_the_sweep_asks_which_jobs_are_expired_by_index(engine: Any, history: datetime) -> None:
    """The sweep asks about every job with files on disk, 1,000 at a time; on PostgreSQL 15 each
    question read the whole table below about 200,000 jobs (23 ms beside 100,000, 4 ms by key)."""
    async with engine.connect() as conn:
        listed: list[uuid.UUID] = list(
            (await conn.execute(text("SELECT id FROM jobs ORDER BY random() LIMIT 1000"))).scalars()
        )
    await read_by_index(engine, sql.EXPIRED_AMONG, {"ids": listed}, most=2 * 1000)
