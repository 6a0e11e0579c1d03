"""An admin cancels many jobs at once (`POST /admin/jobs/cancel`): by model, by owner, or all. A
cancel of a job already asked to stop, one or many, writes nothing."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from sqlalchemy import text

from app import cli_jobs, db
from app.queue import sql
from app.queue.jobs import JobState
from app.queue.manager import JobManager
from tests.conftest import api_client, client_for, png_bytes
from tests.integration.test_batching import CLAIM
from tests.integration.test_durability import alive, kinds, running, until
from tests.integration.test_worker import enqueue

BIG = 40_000  # MB: fits the test GPU of no worker, so the job stays queued


@pytest.fixture
async def api(settings) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(settings) as http:
        yield http


async def states(manager: JobManager, job_ids: list[uuid.UUID]) -> list[JobState]:
    return [(await manager.get(j)).state for j in job_ids]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"states": ["running"]},
        {"all": True, "model": "toy"},
        {"modle": "toy"},
        {"states": []},
        {"owner": ""},
        {"model": ""},
    ],
    ids=["empty", "only states", "all with a model", "misspelt", "no states", "empty owner", "empty model"],
)
async def test_a_bulk_cancel_that_would_take_everyone_unasked_is_refused(manager, api, make_key, body):
    job = await enqueue(manager, vram_mb=BIG)
    response = await api.post("/admin/jobs/cancel", json=body)
    assert response.status_code == 422, response.text
    async with client_for(api, await make_key("tester")) as user:  # a user's key may not
        assert (await user.post("/admin/jobs/cancel", json={"owner": "tester"})).status_code == 403
    assert (await manager.get(job)).state is JobState.queued


async def test_bulk_cancel_by_owner_and_by_a_model_gone_from_the_registry(manager, make_worker, api, store):
    flood = [await enqueue(manager, owner="mallory", vram_mb=BIG) for _ in range(5)]
    gone = [await enqueue(manager, model="dropped", vram_mb=BIG) for _ in range(2)]
    kept = [await enqueue(manager, vram_mb=BIG) for _ in range(2)]
    waiting = await enqueue(manager, owner="mallory", exit_code=3)  # fails, retryable: scheduled
    await make_worker().run()
    assert (await manager.get(waiting)).state is JobState.scheduled
    (store.root / "results" / str(waiting) / ".1.partial").mkdir(parents=True)  # its attempt's leftovers

    both = await api.post("/admin/jobs/cancel", json={"owner": "mallory", "model": "dropped"})
    assert both.json() == {"canceled": 0, "stopping": 0, "left": 0}  # model and owner: jobs matching both
    answer = await api.post("/admin/jobs/cancel", json={"owner": "mallory"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"canceled": 6, "stopping": 0, "left": 0}
    assert await states(manager, [*flood, waiting]) == [JobState.canceled] * 6
    assert not (store.root / "results" / str(waiting) / ".1.partial").exists()  # as a single cancel does
    history = await manager.events(flood[0])
    assert history[-1].kind == "canceled" and history[-1].detail == {"by": "admin"}

    answer = await api.post("/admin/jobs/cancel", json={"model": "dropped"})
    assert answer.json() == {"canceled": 2, "stopping": 0, "left": 0}
    assert await states(manager, [*gone, *kept]) == [JobState.canceled] * 2 + [JobState.queued] * 2
    again = await api.post("/admin/jobs/cancel", json={"model": "dropped"})
    assert again.json() == {"canceled": 0, "stopping": 0, "left": 0}

    answer = await api.post("/admin/jobs/cancel", json={"all": True})
    assert answer.json() == {"canceled": 2, "stopping": 0, "left": 0}
    assert await states(manager, kept) == [JobState.canceled] * 2


async def test_bulk_cancel_goes_by_batches_and_leaves_jobs_submitted_since(manager, engine):
    jobs = [await enqueue(manager, vram_mb=BIG) for _ in range(7)]
    later = await enqueue(manager, vram_mb=BIG)
    async with engine.begin() as conn:  # submitted after the cancel began (a flood still arriving)
        await conn.execute(
            text("UPDATE jobs SET created_at = now() + interval '1 hour' WHERE id = :id"), {"id": later}
        )
    done = await manager.bulk.cancel_matching(by="admin", states={JobState.queued}, model="toy", batch=3)
    assert (done.canceled, done.stopping) == (7, 0)
    assert await states(manager, [*jobs, later]) == [JobState.canceled] * 7 + [JobState.queued]


async def test_bulk_cancel_takes_a_job_another_statement_holds_once_it_is_let_go(manager, engine):
    """Rows are locked SKIP LOCKED (never waiting on, nor deadlocking with, a claim or a heartbeat):
    a job held meanwhile is taken by a later batch, not left queued."""
    free, held = await enqueue(manager, vram_mb=BIG), await enqueue(manager, vram_mb=BIG)
    async with engine.connect() as holder:
        await holder.execute(text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE"), {"id": held})
        everything = manager.bulk.cancel_matching(by="admin", states={JobState.queued}, model="toy")
        cancel = asyncio.create_task(everything)
        await until(manager, free, lambda j: j.state is JobState.canceled)
        assert not cancel.done()  # it waits for the held one, polling, without blocking anyone
        await holder.rollback()
    done = await cancel
    assert (done.canceled, done.stopping) == (2, 0)
    assert await states(manager, [free, held]) == [JobState.canceled] * 2

    stuck = await enqueue(manager, vram_mb=BIG)  # held past the patience: left, and the cancel ends
    async with engine.connect() as holder:
        await holder.execute(text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE"), {"id": stuck})
        done = await manager.bulk.cancel_matching(by="admin", states={JobState.queued}, patience_s=0.3)
        await holder.rollback()
    # It says so: the answer read as complete, and only the log told of the job left.
    assert (done.canceled, done.stopping, done.left) == (0, 0, 1)
    assert (await manager.get(stuck)).state is JobState.queued
    line = cli_jobs.canceled_line({"canceled": 0, "stopping": 0, "left": 1})
    assert line.endswith("; 1 left (held by other statements): run the same command again"), line


async def test_bulk_cancel_stops_running_jobs_through_their_worker(manager, make_worker, api):
    slow = [await enqueue(manager, sleep=30, steps=1) for _ in range(2)]
    queued = await enqueue(manager, vram_mb=BIG)
    # Heartbeats 30 s apart and no progress written (one step): only the NOTIFY stops them in 2 s.
    worker = make_worker([24_576, 24_576], burst=False, heartbeat_interval_s=30, lease_s=60)
    async with running(worker):
        jobs = [await until(manager, j, lambda j: j.pid is not None) for j in slow]
        waiting = await api.post("/admin/jobs/cancel", json={"model": "toy"})  # the waiting ones only
        assert waiting.json() == {"canceled": 1, "stopping": 0, "left": 0}
        assert await states(manager, [*slow, queued]) == [JobState.running] * 2 + [JobState.canceled]

        asked = time.monotonic()
        body = {"model": "toy", "states": ["queued", "scheduled", "running"]}
        answer = await api.post("/admin/jobs/cancel", json=body)
        assert answer.json() == {"canceled": 0, "stopping": 2, "left": 0}
        done = [await until(manager, j, lambda j: j.state.final) for j in slow]
        assert time.monotonic() - asked < 2  # the NOTIFYs reached the worker
        again = await api.post("/admin/jobs/cancel", json=body)  # already asked: not asked again
        assert again.json() == {"canceled": 0, "stopping": 0, "left": 0}
    assert [j.state for j in done] == [JobState.canceled] * 2
    assert not any(alive(j.pid or 0) for j in jobs)
    for job_id in slow:
        assert (await kinds(manager, job_id))[-2:] == ["cancel_requested", "canceled"]


async def test_a_repeated_cancel_of_a_running_job_writes_one_request(manager, api, settings):
    """Before, every POST /jobs/{id}/cancel of a running job wrote another `cancel_requested` event
    and sent two NOTIFYs (every worker woke to look, every stream of the job got an event), for as
    long as the job ran: the kill grace, or a dead worker's whole lease. Now a repeat of a cancel
    still pending answers as the first did (200, running) and writes nothing."""
    job_id = await enqueue(manager)
    await manager.claim(**CLAIM, budgets={0: 10_000}, limit=1)  # running, with no worker to end it
    woken: list[str] = []
    listener = await asyncpg.connect(db.asyncpg_dsn(settings.database_url))
    try:
        await listener.add_listener(sql.CANCEL_CHANNEL, lambda *args: woken.append(args[3]))
        answers = [await api.post(f"/jobs/{job_id}/cancel") for _ in range(20)]
        await asyncio.sleep(0.2)  # the notes arrive
    finally:
        await listener.close()
    assert {(a.status_code, a.json()["state"]) for a in answers} == {(200, "running")}
    assert (await kinds(manager, job_id)).count("cancel_requested") == 1
    assert woken == [str(job_id)]
    assert (await manager.get(job_id)).state is JobState.running


# -- the bulk retry (POST /admin/jobs/retry) ------------------------------------------------------


async def failed_jobs(manager: JobManager, engine, count: int, model: str = "toy") -> list[uuid.UUID]:
    """`count` jobs ended failed, as a run that failed for good leaves them (none of them run)."""
    jobs = [await enqueue(manager, model=model, vram_mb=BIG) for _ in range(count)]
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE jobs SET state = 'failed', attempt = 1, error = 'boom', finished_at = now() "
                "WHERE id = ANY(:ids)"
            ),
            {"ids": jobs},
        )
    return jobs


async def waiting(engine) -> int:
    """Jobs waiting (queued or scheduled): what GPUJOBS_QUEUE_LIMIT counts."""
    async with engine.connect() as conn:
        query = "SELECT count(*) FROM jobs WHERE state IN ('queued', 'scheduled')"
        return int((await conn.execute(text(query))).scalar_one())


async def test_a_bulk_retry_stops_at_the_queue_limit_and_says_how_many_are_left(settings, manager, engine):
    """An admin's bulk retry was held to no limit: 100,000 failed jobs of a model went back at once
    into a queue that GPUJOBS_QUEUE_LIMIT keeps at 10,000 for uploads. It now stops where the queue
    would pass the limit and says how many matching jobs it left, so the operator asks again once
    the queue has room. A single retry is an admin's choice of one job: let through, limit or not."""
    first_waiting = await enqueue(manager, vram_mb=BIG)
    failed = await failed_jobs(manager, engine, 6)
    async with api_client(settings, queue_limit=4) as api:
        first = await api.post("/admin/jobs/retry", json={"model": "toy"})
        assert first.json() == {"retried": 3, "left": 3, "unserved": 0, "queue_full": True}, first.text
        assert await waiting(engine) == 4
        again = await api.post("/admin/jobs/retry", json={})
        assert again.json() == {"retried": 0, "left": 3, "unserved": 0, "queue_full": True}, again.text

        assert (await api.post(f"/jobs/{first_waiting}/cancel")).status_code == 200
        rest = await api.post("/admin/jobs/retry", json={"model": "toy"})
        assert rest.json() == {"retried": 1, "left": 2, "unserved": 0, "queue_full": True}, rest.text
        still_failed = [j for j in failed if (await manager.get(j)).state is JobState.failed]
        assert len(still_failed) == 2

        one = await api.post(f"/admin/jobs/{still_failed[0]}/retry")
        assert one.status_code == 200 and one.json()["state"] == "queued", one.text
        assert await waiting(engine) == 5  # over the limit by the one job the admin asked for
        uploaded = await api.post(
            "/jobs", files={"image": ("a.png", png_bytes(), "image/png")}, data={"model": "toy"}
        )
        assert uploaded.status_code == 429, uploaded.text  # uploads still meet the limit


async def test_a_bulk_retry_goes_by_batches_and_passes_over_jobs_others_hold(manager, engine):
    """The bulk retry locked every matching row in one statement, waiting for each a claim or a
    retention pass held: 100,000 row locks in one transaction, for as long as it took. It now goes
    by batches locked SKIP LOCKED; a job another statement holds is left, and counted so. A job
    that failed after the retry began (one it queued, failing again at once) is not taken again."""
    failed = await failed_jobs(manager, engine, 6)
    async with engine.begin() as conn:  # it finished after the retry began
        await conn.execute(
            text("UPDATE jobs SET finished_at = now() + interval '1 hour' WHERE id = :id"), {"id": failed[5]}
        )
    async with engine.connect() as holder:
        await holder.execute(text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE"), {"id": failed[0]})
        done = await asyncio.wait_for(
            manager.bulk.retry_matching(by="admin", attempts=3, queue_limit=100, batch=2), 10
        )
        await holder.rollback()
    assert (done.retried, done.left, done.queue_full) == (4, 1, False)
    assert await states(manager, failed) == [JobState.failed] + [JobState.queued] * 4 + [JobState.failed]
    history = await manager.events(failed[1])
    assert history[-1].kind == "retried" and history[-1].detail == {"by": "admin"}


async def test_two_bulk_retries_at_once_do_not_both_fill_the_same_room(manager, engine):
    """Each bulk retry counted the jobs waiting, then queued as many as the room it saw: two at once
    both saw the same room and both filled it, taking the queue past its limit by a batch. A batch
    now counts and retries while it holds a lock every bulk retry takes, so the second one counts
    after the first's batch is in. Forced here: a holder keeps both batches from writing their
    events until both have had the chance to count."""
    failed = await failed_jobs(manager, engine, 8)
    async with engine.connect() as holder:
        await holder.execute(text("LOCK TABLE job_events IN EXCLUSIVE MODE"))
        both = [
            asyncio.ensure_future(manager.bulk.retry_matching(by="admin", attempts=3, queue_limit=3))
            for _ in range(2)
        ]
        await asyncio.sleep(0.5)  # both have counted, if nothing keeps the second from it
        assert not any(task.done() for task in both)
        await holder.rollback()
    done = await asyncio.wait_for(asyncio.gather(*both), 10)
    assert await waiting(engine) == 3
    assert sorted(d.retried for d in done) == [0, 3]
    assert all(d.left == 5 and d.queue_full for d in done)
    assert len([j for j in failed if (await manager.get(j)).state is JobState.queued]) == 3


async def test_failed_jobs_of_a_model_gone_from_the_registry_are_counted_and_refused_by_name(
    manager, engine, api
):
    """A bulk retry looked only at the models in the API's registry: failed jobs of a model dropped
    from it were neither retried nor counted ({"retried": 0, "left": 0}, "none left") while they
    stayed listed as failed, and a single retry of one answered 422 "model: unknown model", about a
    field the admin never sent. No worker of this registry would run them, so they are still not
    queued again, but the bulk answer counts them (`unserved`), and the single retry says why, in
    terms of the job, with a 409 that changes nothing."""
    gone = await failed_jobs(manager, engine, 2, model="gone")
    served = await failed_jobs(manager, engine, 1)
    answer = await api.post("/admin/jobs/retry", json={})
    assert answer.json() == {"retried": 1, "left": 0, "unserved": 2, "queue_full": False}, answer.text
    line = cli_jobs.retried_line(answer.json())
    assert "none left" not in line and "2 not retried" in line and "registry" in line, line
    assert await states(manager, [*gone, *served]) == [JobState.failed] * 2 + [JobState.queued]
    filtered = await api.post("/admin/jobs/retry", json={"error_contains": "boom"})
    assert filtered.json()["unserved"] == 2, filtered.text  # the filter applies to them too

    one = await api.post(f"/admin/jobs/{gone[0]}/retry")
    assert one.status_code == 409, one.text
    detail = one.json()["detail"]
    assert str(gone[0]) in detail and "'gone'" in detail and "registry" in detail, detail
    assert not detail.startswith("model:"), detail
    assert await states(manager, gone) == [JobState.failed] * 2


@pytest.mark.parametrize("body", [{"error_contains": ""}, {"model": ""}], ids=["empty error", "empty model"])
async def test_a_bulk_retry_with_an_empty_filter_is_refused_not_widened(manager, engine, api, body):
    """`{"error_contains": ""}` (a script's unset $PATTERN) matched every failed job, since every
    error contains "": it queued them all again. An empty filter is a 422 now, as GET /jobs's."""
    failed = await failed_jobs(manager, engine, 2)
    answer = await api.post("/admin/jobs/retry", json=body)
    assert answer.status_code == 422, answer.text
    assert await states(manager, failed) == [JobState.failed] * 2


@pytest.mark.parametrize("state", ["queued", "succeeded"])
async def test_a_retry_refused_for_its_state_says_so_even_if_its_model_is_gone(manager, engine, api, state):
    """A queued or succeeded job of a model gone from the registry was told to add the model back to
    be retried, which led only to a second 409, for its state."""
    job = await enqueue(manager, vram_mb=BIG)
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE jobs SET model = 'gone', state = CAST(:state AS job_state) WHERE id = :id"),
            {"id": job, "state": state},
        )
    answer = await api.post(f"/admin/jobs/{job}/retry")
    assert answer.status_code == 409, answer.text
    assert (
        answer.json()["detail"]
        == f"job {job} is {state}; only failed, canceled or quarantined jobs can be retried"
    )
