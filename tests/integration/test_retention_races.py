"""Retention racing uploads: each race is made to happen at its exact moment.

Uploads: a second connection holds a lock that pauses one side in the middle of its statement
while the other side runs, and the test waits until PostgreSQL reports the waits.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from sqlalchemy import text

from app import images, retention
from app.queue.manager import JobManager, NewJob
from tests.integration.test_retention import WEEK_S, age, image
from tests.integration.test_worker import enqueue

# Backends of this test's database waiting for a lock (a row, or another transaction's end).
LOCK_WAITS = text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
)


async def until_waiting(engine: Any, waits: int, *tasks: asyncio.Future[Any], timeout_s: float = 10) -> None:
    """Until `waits` backends wait for a lock, or one of `tasks` ended (it did not wait)."""
    deadline = time.monotonic() + timeout_s
    async with engine.connect() as conn:
        while await conn.scalar(LOCK_WAITS) < waits and not any(t.done() for t in tasks):
            assert time.monotonic() < deadline, f"fewer than {waits} lock waits"
            await conn.rollback()  # a fresh snapshot of pg_stat_activity
            await asyncio.sleep(0.02)


async def finished_and_aged(manager: JobManager, engine: Any, shade: int) -> uuid.UUID:
    """A canceled job of image(shade) that finished ten days ago (retention takes it)."""
    job_id = await enqueue(manager, image=image(shade))
    await manager.cancel(job_id, owner=None, by="test")
    await age(engine, job_id)
    return job_id


async def test_an_upload_that_found_its_image_keeps_it_from_retention(manager, engine, store):
    """An upload of an image already stored finds its row, then inserts the job. Retention could
    delete the row in between (its last job expired), and the insert failed on the foreign key:
    a 500, and the upload lost. The upload now holds the row from the moment it finds it, so
    retention waits for the new job and keeps the image."""
    old = await finished_and_aged(manager, engine, 1)
    upload = NewJob("tester", "toy", {}, 0, 1000, 3, idempotency_key="k")
    async with engine.connect() as holder:
        # A transaction holding the upload's idempotency key pauses the upload at its job insert,
        # after it found the image.
        await holder.execute(
            text(
                "INSERT INTO jobs (owner, model, megapixels, vram_mb, max_attempts, idempotency_key)"
                " VALUES ('tester', 'toy', 0, 1000, 3, 'k')"
            )
        )
        checked = images.inspect(image(1), max_pixels=10**8)
        uploading = asyncio.create_task(manager.enqueue(upload, checked, queue_limit=100))
        await until_waiting(engine, 1, uploading)
        pruning = asyncio.create_task(retention.Pruner(manager, store.root).prune(older_than_s=WEEK_S))
        await until_waiting(engine, 2, uploading, pruning)
        await holder.rollback()
    job, created = await uploading
    report = await pruning
    assert created and job.input_id is not None
    assert (await manager.input_by_id(job.input_id))[1] == image(1)
    assert report.jobs == 1 and report.inputs_deleted == 0
    assert (await manager.get(old)).expired_at is not None


async def test_an_upload_during_retention_deleting_its_image_stores_it_again(manager, engine, store):
    """The other order: retention has taken the image's row to delete it when the upload looks for
    it. The upload waits for retention's transaction and stores the image again. (Before, the
    upload used the row retention was deleting, and retention failed on the foreign key.)"""
    earlier = await finished_and_aged(manager, engine, 1)
    old = await finished_and_aged(manager, engine, 1)
    async with engine.begin() as conn:  # expired while `old` still used the image: it keeps its id
        await conn.execute(text("UPDATE jobs SET expired_at = now() WHERE id = :id"), {"id": earlier})
    async with engine.connect() as holder:
        # Retention pauses when it detaches the image from `earlier`, after it took the image.
        await holder.execute(text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE"), {"id": earlier})
        pruning = asyncio.create_task(retention.Pruner(manager, store.root).prune(older_than_s=WEEK_S))
        await until_waiting(engine, 1, pruning)
        uploading = asyncio.create_task(enqueue(manager, image=image(1)))
        await until_waiting(engine, 2, pruning, uploading)
        await holder.rollback()
    report = await pruning
    job = await manager.get(await uploading)
    assert report.jobs == 1 and report.inputs_deleted == 1
    assert job.input_id is not None and (await manager.input_by_id(job.input_id))[1] == image(1)
    assert (await manager.get(old)).input_id is None and (await manager.get(earlier)).input_id is None
