"""Retention racing uploads and downloads: each race is made to happen at its exact moment.

Uploads: a second connection holds a lock that pauses one side in the middle of its statement
while the other side runs, and the test waits until PostgreSQL reports the waits. Downloads: a
method of the API's manager or store is wrapped to do retention's work right after it returns.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from app import images, retention
from app.queue import records, sql
from app.queue.manager import JobManager
from tests.conftest import api_client
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
    upload = records.NewJob("tester", "toy", {}, 0, 1000, 3, idempotency_key="k")
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
    assert (await manager.inputs.by_id(job.input_id))[1] == image(1)
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
    assert job.input_id is not None and (await manager.inputs.by_id(job.input_id))[1] == image(1)
    assert (await manager.get(old)).input_id is None and (await manager.get(earlier)).input_id is None


async def done_jobs(manager: JobManager, make_worker: Any, count: int) -> list[uuid.UUID]:
    """`count` jobs run to success, each with an image of its own."""
    jobs = [await enqueue(manager, image=image(10 + n)) for n in range(count)]
    await make_worker().run()
    return jobs


def open_descriptors(path: Path) -> list[int]:
    """This process's file descriptors open on `path` (deleted or not)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            continue
        if target.removesuffix(" (deleted)") == str(path):
            found.append(int(fd))
    return found


async def test_a_download_while_retention_deletes_the_files_is_gone(
    settings, manager, make_worker, engine, store
):
    """A download reads its job, then looks for the file. Retention could expire the job and
    delete its files in between: the link answered 404 (a log: 200, empty) where a moment later it
    answers 410. A file found missing now sends the route back to the job."""
    jobs = await done_jobs(manager, make_worker, 4)
    async with api_client(settings) as http:
        shown = [(await http.get(f"/jobs/{job_id}")).json() for job_id in jobs]
        services = http.app.state.services
        read = services.manager.get
        raced: set[uuid.UUID] = set()

        async def read_then_prune(job_id: uuid.UUID, **kwargs: Any) -> Any:
            job = await read(job_id, **kwargs)
            if job_id not in raced:  # the route's first read of the job
                raced.add(job_id)
                await retention.Pruner(manager, store.root).prune(older_than_s=WEEK_S)
            return job

        services.manager.get = read_then_prune
        requests = [
            ("GET", shown[0]["files"][0]["url"]),
            ("HEAD", shown[1]["files"][0]["url"]),
            ("GET", shown[2]["links"]["log"]),
            ("GET", f"/jobs/{jobs[3]}/input"),
        ]
        for job_id, (method, url) in zip(jobs, requests, strict=True):
            await age(engine, job_id)  # retention takes this one job when it runs
            answer = await http.request(method, url)
            assert answer.status_code == 410, (method, url, answer.status_code, answer.text)
            assert method == "HEAD" or "deleted by retention" in answer.json()["detail"]
            assert (await manager.get(job_id)).expired_at is not None


@pytest.mark.parametrize("expired", [True, False], ids=["expired", "missing"])
async def test_a_file_deleted_after_the_route_found_it_is_not_a_500(
    settings, manager, make_worker, engine, store, expired
):
    """Retention marks a job expired, then deletes its files. A download that read the job before
    the mark and found its file before the deletion answered with a path gone by the time the
    response opened it: a 500. Now 410, and 404 for a file missing from a job not expired."""
    [job_id] = await done_jobs(manager, make_worker, 1)
    async with api_client(settings) as http:
        url = (await http.get(f"/jobs/{job_id}")).json()["files"][0]["url"]
        services = http.app.state.services
        read, resolve = services.manager.get, services.store.resolve

        async def read_then_expire(job_id: uuid.UUID, **kwargs: Any) -> Any:
            job = await read(job_id, **kwargs)
            if expired:
                async with engine.begin() as conn:
                    expire = "UPDATE jobs SET expired_at = coalesce(expired_at, now()) WHERE id = :id"
                    await conn.execute(text(expire), {"id": job_id})
            return job

        def resolve_then_delete(job: Any, name: str) -> Any:
            found = resolve(job, name)
            found[0].unlink()
            return found

        services.manager.get, services.store.resolve = read_then_expire, resolve_then_delete
        answer = await http.get(url)
    assert answer.status_code == (410 if expired else 404), answer.text
    assert ("deleted by retention" if expired else "not on disk") in answer.json()["detail"]


async def test_a_download_sends_the_whole_file_it_opened_though_retention_deletes_it(
    settings, manager, make_worker, store
):
    """Once the route has opened the file, all of it is sent (ranges and HEAD as before), though
    retention deletes it before the response reads it; and the file is closed after."""
    [job_id] = await done_jobs(manager, make_worker, 1)
    path = store.resolve(await manager.get(job_id), "out.txt")[0]
    content = path.read_bytes()
    async with api_client(settings) as http:
        url = (await http.get(f"/jobs/{job_id}")).json()["files"][0]["url"]
        services = http.app.state.services
        opener = services.store.open

        def open_then_delete(job: Any, name: str) -> Any:
            opened = opener(job, name)
            path.unlink()
            return opened

        services.store.open = open_then_delete
        for method, ranges, status in (
            ("GET", None, 200),
            ("GET", "bytes=0-3", 206),
            ("GET", "bytes=0-1,5-6", 206),
            ("HEAD", None, 200),
            ("GET", "bytes=999-", 416),
        ):
            path.write_bytes(content)
            answer = await http.request(method, url, headers={"Range": ranges} if ranges else {})
            assert answer.status_code == status, (method, ranges, answer.text)
            assert not path.exists() and open_descriptors(path) == []
            if method == "HEAD":
                assert answer.headers["content-length"] == str(len(content)) and answer.content == b""
            elif ranges is None:
                assert answer.content == content and answer.headers["etag"].startswith('"')
            elif ranges == "bytes=0-3":
                assert answer.content == content[:4]
            elif status == 206:
                assert answer.headers["content-type"].startswith("multipart/byteranges")
                assert content[:2] in answer.content and content[5:7] in answer.content


async def test_a_retry_while_retention_expires_the_job_is_gone(settings, manager, engine):
    """An admin retries a canceled job while retention expires it: the route read the job before
    the mark, the retry's statement found it expired and changed nothing, and the answer was a 409
    that contradicted itself ("job ... is canceled; only failed or canceled jobs can be retried").
    Now 410, as for a job that had expired before the retry."""
    job_id = await finished_and_aged(manager, engine, 40)
    pruner = retention.Pruner(manager, settings.storage_dir)
    async with api_client(settings) as http:
        services = http.app.state.services
        read = services.manager.get

        async def read_then_prune(job_id: uuid.UUID, **kwargs: Any) -> Any:
            job = await read(job_id, **kwargs)
            services.manager.get = read  # once
            await pruner.prune(older_than_s=WEEK_S)
            return job

        services.manager.get = read_then_prune
        answer = await http.post(f"/admin/jobs/{job_id}/retry")
    assert answer.status_code == 410, answer.text
    assert "retention" in answer.json()["detail"]
    assert (await manager.get(job_id)).state.value == "canceled"


async def test_an_upload_that_lost_an_idempotency_race_leaves_no_image_behind(manager: JobManager, engine):
    """Two uploads with one idempotency key and different images at once: the second waits for the
    first's job on the key, finds it taken and is refused (409), but the image it had stored stayed,
    used by no job and never pruned (retention deletes only the images of expired jobs): refused
    uploads that fill the disk, past every queue limit."""
    first, second = (images.inspect(image(shade), max_pixels=10**8) for shade in (10, 20))
    job = records.NewJob("carol", "toy", {}, 0, 1000, 3, idempotency_key="k")
    async with engine.connect() as holder:  # the first upload's statement, not committed yet
        values = job.enqueue_values(first, queue_limit=10_000, owner_limit=0)
        await holder.execute(sql.ENQUEUE, {**values, "count_waiting": False})
        losing = asyncio.create_task(manager.enqueue(job, second, queue_limit=10_000))
        await until_waiting(engine, 1, losing)
        await holder.commit()
    taken, created = await losing
    assert not created and taken.input_id is not None
    async with engine.connect() as conn:
        hashes = (await conn.execute(text("SELECT sha256 FROM inputs ORDER BY id"))).scalars().all()
    assert hashes == [first.sha256]
