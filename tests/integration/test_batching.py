"""Claims and finishes in batches: many jobs per round trip, each placed and fenced on its own."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.util import greenlet_spawn

from app import db, errors
from app.queue import sql
from app.queue.jobs import JobState, classes_up_to, vram_class
from app.queue.manager import JobManager
from tests import plans
from tests.integration.test_durability import running, until
from tests.integration.test_worker import enqueue

CLAIM = {"worker_id": "test:w", "host": "h", "models": ["toy"], "lease_s": 60}


async def claimed_events(engine: Any) -> int:
    async with engine.connect() as conn:
        return int(await conn.scalar(text("SELECT count(*) FROM job_events WHERE kind = 'claimed'")))


async def both_plans(engine: Any, monkeypatch: Any, run: Callable[[], Awaitable[Any]]) -> list[Any]:
    """auto_explain's reports of the statement `run()` sends through `db.fetch_rows`, as the
    service sends it: under a custom plan, then under the generic plan a prepared statement may use
    (tests/plans.py). Each is rolled back, so `run()` sees no rows come back."""
    reports: list[Any] = []

    async def explained(_engine: Any, statement: Any, values: Any) -> list[Any]:
        for mode in ("force_custom_plan", "force_generic_plan"):
            reports.extend(await plans.prepared_reports(engine, statement, values, mode))
        return []

    with monkeypatch.context() as patched:
        patched.setattr(db, "fetch_rows", explained)
        await run()
    assert len(reports) == 2, reports
    return reports


async def claim_plans(manager: JobManager, engine: Any, monkeypatch: Any, claim: dict[str, Any]) -> list[Any]:
    """`both_plans` of `manager.claim(**claim)`, which claims nothing there."""

    async def run() -> None:
        assert await manager.claim(**claim) == []

    await manager.teller.flush()  # the enqueues' NOTIFYs, sent in the background, are not the claim
    return await both_plans(engine, monkeypatch, run)


async def test_a_batch_is_taken_best_first_in_one_statement(manager: JobManager, engine):
    ids = {p: await enqueue(manager, priority=p, image=None, steps=p) for p in (1, 5, 3, 9, 7)}
    batch = await manager.claim(**CLAIM, budgets={0: 10_000}, limit=3)
    assert [c.job.id for c in batch] == [ids[9], ids[7], ids[5]]
    assert all(c.job.state is JobState.running and c.job.attempt == 1 and c.job.gpu == 0 for c in batch)
    assert all(c.input is not None and c.input[0] == "image/png" for c in batch)  # images ride along
    assert await claimed_events(engine) == 3
    rest = await manager.claim(**CLAIM, budgets={0: 10_000}, limit=10)
    assert [c.job.id for c in rest] == [ids[3], ids[1]]


async def test_a_claim_does_not_read_the_jobs_already_done(manager: JobManager, engine, monkeypatch):
    """A claim reads its candidates and the rows it takes by index, never the whole table. The
    plan once joined the taken rows to `jobs` by a sequential scan: 5 ms per claim beside 12,000
    finished jobs, growing with every job ever run. Checked on the custom plan PostgreSQL makes
    for the claim's values and on the generic plan a prepared statement may switch to."""
    await enqueue(manager)
    async with engine.begin() as conn:
        await conn.execute(plans.FINISHED_BESIDE, {"count": 10_000})
        await conn.execute(plans.INPUTS_BESIDE, {"count": 10_000})
        await conn.execute(text("ANALYZE jobs, inputs"))
    for _ in range(7):
        await enqueue(manager)
    # A worker of several models on a large GPU probes many (model, size class) pairs.
    many = {**CLAIM, "models": ["toy", "other", "third", "fourth"], "budgets": {0: 10**6}, "limit": 8}

    for report in await claim_plans(manager, engine, monkeypatch, many):
        plan = report["Plan"]
        assert "Seq Scan" not in plans.scans_of(plan, "jobs"), plan
        assert "Seq Scan" not in plans.scans_of(plan, "inputs"), plan  # images by key too
        updated = [n for n in plans.nodes(plan) if n["Node Type"] == "ModifyTable"]
        assert [n["Actual Rows"] for n in updated if n["Relation Name"] == "jobs"] == [8], plan
    assert len(await manager.claim(**many)) == 8  # what the plans showed was rolled back


async def test_a_claim_is_never_jit_compiled(manager: JobManager, engine, monkeypatch):
    """The claim's plan is estimated dear: the placement is a recursive walk, and a worker of several
    models on a large GPU probes hundreds of (model, size class) pairs. Past `jit_above_cost`,
    PostgreSQL compiled it with LLVM on every run: 30-40 ms against 1-2 ms of work (a claim of 8
    of 20,000 jobs, 10 models on 80 GB, PostgreSQL 15). The service's connections turn JIT off.
    Only where the server can JIT (the Debian and Docker builds can; the embedded one cannot)."""
    async with engine.begin() as conn:
        assert await conn.scalar(text("SHOW jit")) == "off"
        await conn.execute(text("SET LOCAL jit = on"))  # pg_jit_available() is false while jit is off
        if not await conn.scalar(text("SELECT pg_jit_available()")):
            pytest.skip("this PostgreSQL has no JIT")
        jit_above_cost = float(await conn.scalar(text("SHOW jit_above_cost")))
    await enqueue(manager)
    async with engine.begin() as conn:  # a deep queue: the planner's row estimates grow with it
        await conn.execute(plans.QUEUED_BESIDE, {"count": 20_000})
        await conn.execute(text("ANALYZE jobs"))
    many = {**CLAIM, "models": ["toy", *(f"other-{i}" for i in range(9))], "budgets": {0: 80_000}, "limit": 8}
    reports = await claim_plans(manager, engine, monkeypatch, many)
    assert max(r["Plan"]["Total Cost"] for r in reports) > jit_above_cost  # JIT would have compiled it
    assert [r.get("JIT") for r in reports] == [None, None]


async def test_a_claim_probes_only_the_size_classes_its_models_have_queued(
    manager: JobManager, engine, monkeypatch
):
    """A worker on a large GPU may take jobs of ~100 size classes per model, nearly all empty. The
    claim probes only the classes from each model's smallest queued one to its largest that fits
    (two probes find them), so a model with nothing queued costs two probes, not one per class."""
    for mb in (1000, 1000, 6000):  # two classes of one model
        await enqueue(manager, vram_mb=mb)
    many = {**CLAIM, "models": ["toy", "other", "third", "fourth"], "budgets": {0: 10**6}, "limit": 8}
    assert len(classes_up_to(10**6)) == 96  # what the claim probed for each model before
    for report in await claim_plans(manager, engine, monkeypatch, many):
        plan = report["Plan"]
        probes = [n for n in plans.nodes(plan) if n.get("Index Name") == "ix_jobs_claim"]
        loops = sum(n["Actual Loops"] for n in probes)
        # 4 models x 2 probes for their span, then 1 probe per class from 1000 MB to 6000 MB
        assert loops <= 4 * 2 + (vram_class(6000) - vram_class(1000) + 1), (loops, plan)
        updated = [n for n in plans.nodes(plan) if n["Node Type"] == "ModifyTable"]
        assert [n["Actual Rows"] for n in updated if n["Relation Name"] == "jobs"] == [3]
    assert sorted(c.job.vram_mb for c in await manager.claim(**many)) == [1000, 1000, 6000]


async def test_a_claim_over_the_budget_of_every_queued_class_takes_nothing(manager: JobManager):
    await enqueue(manager, vram_mb=6000)
    assert await manager.claim(**CLAIM, budgets={0: 5000}, limit=4) == []  # its class is above the span
    small = await enqueue(manager, vram_mb=1000)
    assert [c.job.id for c in await manager.claim(**CLAIM, budgets={0: 5000}, limit=4)] == [small]


@contextlib.asynccontextmanager
async def queue_manager(manager: JobManager, url: str) -> AsyncIterator[tuple[JobManager, Any, list[str]]]:
    """A manager whose claims and successes go through db.create_queue_engine, as a worker's do;
    with it, that engine and the notices of its connection (used one statement at a time, so there
    is one), where auto_explain reports each statement (`plans.explain_reports`)."""
    queue_engine = db.create_queue_engine(url)
    notices: list[str] = []
    pooled = await queue_engine.raw_connection()
    driver = pooled.driver_connection
    driver.add_log_listener(lambda _conn, message: notices.append(message.message))
    await driver.execute(plans.auto_explain())
    await greenlet_spawn(pooled.close)
    try:
        yield JobManager(manager._engine, queue_engine=queue_engine), queue_engine, notices
    finally:
        await queue_engine.dispose()


async def test_claims_and_successes_keep_one_generic_plan(manager: JobManager, settings):
    """PostgreSQL planned the claim afresh on every run (its generic plan is estimated far dearer
    than a custom plan, so a prepared statement never switched), and that planning was a third of
    the server's CPU per job. The worker's queue connection forces the generic plan."""
    assert settings.database_url
    async with queue_manager(manager, settings.database_url) as (queue, queue_engine, _):
        for _ in range(14):
            await enqueue(manager)
        for _ in range(6):
            [claimed] = await queue.claim(**CLAIM, budgets={0: 10**6}, limit=1)
            await queue.succeed(claimed.job, [], {})
        [claimed] = await queue.claim(**CLAIM, budgets={0: 10**6}, limit=1)
        for _ in range(7):  # each claim carries the success of the job before
            [claimed] = await claim_carrying(queue, claimed.job)
        await queue.succeed(claimed.job, [], {})
        pooled = await queue_engine.raw_connection()
        try:
            driver = pooled.driver_connection
            assert await driver.fetchval("SHOW application_name") == "gpujobs queue"
            counts = [
                tuple(
                    await driver.fetchrow(
                        "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
                        db._driver_sql(statement, queue_engine.dialect).string,
                    )
                )
                for statement in (sql.CLAIM, sql.SUCCEED, sql.SUCCEED_AND_CLAIM)
            ]
        finally:
            await greenlet_spawn(pooled.close)
    assert counts == [(7, 0), (7, 0), (7, 0)]


async def claim_carrying(queue: JobManager, job: Any) -> list[Any]:
    """One claim of at most one job by `queue`, carrying `job`'s success (which must be written)."""
    queue.hold_successes(10.0)
    finishing = asyncio.create_task(queue.succeed(job, [], {}))
    await asyncio.sleep(0)  # reported, held for the claim
    claimed = await queue.claim(**CLAIM, budgets={0: 10**6}, limit=1)
    await finishing
    return claimed


async def test_plans_made_while_the_table_was_small_still_read_by_index(
    manager: JobManager, engine, settings
):
    """A generic plan is kept until an ANALYZE invalidates it. Made while `jobs` held a few rows, it
    scanned the table, and kept scanning as the table grew: a claim took 87-108 ms beside 20,000
    jobs, a success 38-69 ms beside 160,000. The queue connection makes its plans without
    sequential scans, so the plan for a small table is one for a large table too."""
    assert settings.database_url
    async with queue_manager(manager, settings.database_url) as (queue, _, notices):
        for _ in range(6):
            await enqueue(manager)
        async with engine.begin() as conn:
            await conn.execute(text("ANALYZE jobs"))

        async def claim_succeed_and_claim() -> None:  # each statement once
            [first] = await queue.claim(**CLAIM, budgets={0: 10**6}, limit=1)
            await queue.succeed(first.job, [], {})
            [second] = await queue.claim(**CLAIM, budgets={0: 10**6}, limit=1)
            assert len(await claim_carrying(queue, second.job)) == 1

        await claim_succeed_and_claim()  # the plans are made now
        async with engine.begin() as conn:  # the table grows; no ANALYZE comes
            await conn.execute(plans.FINISHED_BESIDE, {"count": 2000})
        notices.clear()
        await claim_succeed_and_claim()
    reports = plans.explain_reports(notices)
    assert len(reports) == 4, notices
    for report in reports:
        assert "Seq Scan" not in plans.scans_of(report["Plan"], "jobs"), report["Plan"]
        assert plans.rows_read(report["Plan"], "jobs") < 100, report["Plan"]


async def test_a_worker_process_claims_on_its_own_connection(manager: JobManager, engine, spawn_worker):
    """`gpujobs worker` claims through db.create_queue_engine (the connection named for it)."""
    job_id = await enqueue(manager, sleep=30)
    spawn_worker("claims")
    await until(manager, job_id, lambda j: j.state is JobState.running)
    async with engine.connect() as conn:
        named = await conn.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = 'gpujobs queue'"
            )
        )
    assert named == 1


async def test_placement_respects_each_gpus_megabytes_and_slots(manager: JobManager):
    # Best first: 6000, 6000, 5000, 1000, 1000 MB. GPU 0 has 10000 MB, GPU 1 has 7000 MB and one slot.
    sizes = [(50, 6000), (40, 6000), (30, 5000), (20, 1000), (10, 1000)]
    ids = {mb_p: await enqueue(manager, priority=mb_p[0], vram_mb=mb_p[1]) for mb_p in sizes}
    batch = await manager.claim(**CLAIM, budgets={0: 10_000, 1: 7_000}, slots={0: 8, 1: 1}, limit=8)
    placed = {c.job.id: c.job.gpu for c in batch}
    # 6000 -> GPU 1 (tightest), 6000 -> GPU 0, 5000 fits nowhere now (skipped, stays queued),
    # 1000 -> GPU 0, 1000 -> GPU 0 (GPU 1 has no slot left).
    assert placed == {ids[(50, 6000)]: 1, ids[(40, 6000)]: 0, ids[(20, 1000)]: 0, ids[(10, 1000)]: 0}
    assert (await manager.get(ids[(30, 5000)])).state is JobState.queued
    used = Counter()
    for c in batch:
        used[c.job.gpu] += c.job.vram_mb
    assert used[0] <= 10_000 and used[1] <= 7_000


async def test_a_batch_stops_at_its_limit_and_at_free_slots(manager: JobManager):
    for _ in range(6):
        await enqueue(manager)
    assert len(await manager.claim(**CLAIM, budgets={0: 50_000}, limit=2)) == 2
    assert len(await manager.claim(**CLAIM, budgets={0: 50_000}, slots={0: 3}, limit=16)) == 3
    assert await manager.claim(**CLAIM, budgets={0: 50_000}, slots={0: 0}, limit=16) == []


async def test_concurrent_batch_claims_never_share_a_job(manager: JobManager):
    for _ in range(120):
        await enqueue(manager)

    async def claimer(n: int) -> list[Any]:
        got = []
        while batch := await manager.claim(
            **{**CLAIM, "worker_id": f"test:w{n}"}, budgets={0: 10**6}, limit=7
        ):
            got += [c.job.id for c in batch]
        return got

    taken = [job for got in await asyncio.gather(*(claimer(n) for n in range(4))) for job in got]
    assert len(taken) == 120 and len(set(taken)) == 120


async def test_successes_reported_together_share_a_statement_and_are_fenced_each(manager: JobManager, engine):
    for _ in range(10):
        await enqueue(manager)
    batch = await manager.claim(**CLAIM, budgets={0: 50_000}, limit=10)
    lost = batch[3].job
    async with engine.begin() as conn:  # taken from us: its success must be refused, alone
        await conn.execute(text("UPDATE jobs SET state = 'queued' WHERE id = :id"), {"id": lost.id})
    before = manager._successes.statements
    outcomes = await asyncio.gather(
        *(manager.succeed(c.job, [], {"duration_s": 0.1}) for c in batch), return_exceptions=True
    )
    assert [type(o) for o in outcomes].count(errors.LeaseLost) == 1
    assert isinstance(outcomes[3], errors.LeaseLost)
    assert manager._successes.statements - before <= 2  # the first alone, the other nine together
    states = Counter([(await manager.get(c.job.id)).state for c in batch])
    assert states == {JobState.succeeded: 9, JobState.queued: 1}
    async with engine.connect() as conn:
        events = await conn.scalar(text("SELECT count(*) FROM job_events WHERE kind = 'succeeded'"))
    assert events == 9


async def test_a_claim_carries_the_successes_waiting_for_it(manager: JobManager, engine, settings):
    """A worker ends jobs and fills their slots in the same moments: successes reported while its
    claim is due go out in the claim's statement. Each is fenced as it is alone and writes its event
    and NOTIFY, and the claim takes its jobs as ever."""
    for _ in range(5):
        await enqueue(manager)
    ended = [c.job for c in await manager.claim(**CLAIM, budgets={0: 50_000}, limit=3)]
    async with engine.begin() as conn:  # a newer attempt runs elsewhere: this one's success is refused
        await conn.execute(text("UPDATE jobs SET attempt = attempt + 1 WHERE id = :id"), {"id": ended[2].id})
    heard: list[dict[str, Any]] = []
    listener = await asyncpg.connect(db.asyncpg_dsn(settings.database_url))
    try:
        await listener.add_listener(sql.JOB_CHANNEL, lambda *args: heard.append(json.loads(args[3])))
        manager.hold_successes(10.0)
        finishing = [asyncio.create_task(manager.succeed(job, [], {"duration_s": 0.1})) for job in ended]
        await asyncio.sleep(0.05)
        assert not any(task.done() for task in finishing)  # held for the claim
        taken = await manager.claim(**CLAIM, budgets={0: 50_000}, limit=2)
        outcomes = await asyncio.gather(*finishing, return_exceptions=True)
        await until_true(lambda: len(heard) >= 4)
    finally:
        await listener.close()
    assert outcomes[:2] == [None, None] and isinstance(outcomes[2], errors.LeaseLost)
    assert (manager._successes.statements, manager._successes.carried) == (0, 3)
    assert len(taken) == 2 and {c.job.id for c in taken}.isdisjoint(job.id for job in ended)
    assert all(c.input is not None and c.job.state is JobState.running for c in taken)
    states = [(await manager.get(job.id)).state for job in ended]
    assert states == [JobState.succeeded, JobState.succeeded, JobState.running]
    async with engine.connect() as conn:
        events = dict((await conn.execute(text("SELECT kind, count(*) FROM job_events GROUP BY kind"))).all())
    assert (events["succeeded"], events["claimed"]) == (2, 5)
    told = Counter((note["kind"], note["state"]) for note in heard)
    assert told == {("succeeded", "succeeded"): 2, ("claimed", "running"): 2}


async def until_true(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_successes_ride_a_claim_that_finds_nothing(manager: JobManager):
    await enqueue(manager)
    [claimed] = await manager.claim(**CLAIM, budgets={0: 50_000})
    manager.hold_successes(10.0)
    finishing = asyncio.create_task(manager.succeed(claimed.job, [], {}))
    await asyncio.sleep(0)
    assert await manager.claim(**CLAIM, budgets={0: 50_000}) == []  # the queue is empty
    await finishing
    assert (await manager.get(claimed.job.id)).state is JobState.succeeded
    assert (manager._successes.statements, manager._successes.carried) == (0, 1)


async def test_held_successes_go_out_on_their_own_when_no_claim_is_sent(manager: JobManager):
    """No room on any GPU: no claim statement goes out, so the successes held for it are written
    at once, not when the hold runs out."""
    for _ in range(2):
        await enqueue(manager)
    [claimed] = await manager.claim(**CLAIM, budgets={0: 50_000})
    manager.hold_successes(10.0)
    finishing = asyncio.create_task(manager.succeed(claimed.job, [], {}))
    await asyncio.sleep(0)
    assert await manager.claim(**CLAIM, budgets={0: 0}) == []
    await asyncio.wait_for(finishing, 2.0)
    assert (manager._successes.statements, manager._successes.carried) == (1, 0)


async def test_a_worker_writes_its_successes_in_its_claims(manager: JobManager, make_worker):
    """A job's success waits (the claim gather and a few ms at most) for the claim that fills its
    slot, and rides it. Without the wait, most were written on their own: 0 or 1 of 6 rode; with
    it, 5 or 6 on an idle machine, and 4 on one busy with other tests; with a gather of 20 ms, 3 in
    2 of 6 runs beside the tests that start several API processes; with 100 ms, 3 in 1 of 6 runs
    on a 2-core VM kept busy by two other processes (and 1 once in `make test`), and 4 or more in 8
    of 8 there with 500 ms."""
    ids = [await enqueue(manager, steps=0) for _ in range(6)]
    await manager.teller.flush()  # the enqueues' wake-ups, sent in the background, not mid-run
    await make_worker(max_jobs_per_gpu=2, claim_gather_s=0.5).run()
    assert {(await manager.get(i)).state for i in ids} == {JobState.succeeded}
    assert manager._successes.carried >= 4, (manager._successes.carried, manager._successes.statements)


async def test_a_success_reads_only_its_own_jobs(manager: JobManager, engine, monkeypatch):
    """The finish read every running job (ix_jobs_worker, whatever the worker) to update a few:
    its generic plan guessed the ids' unnest at 100 rows. It reads its rows by key now."""
    for _ in range(3):
        await enqueue(manager)
    async with engine.begin() as conn:
        await conn.execute(plans.QUEUED_BESIDE, {"count": 400})
    taken = []
    while len(taken) < 1000:  # about a thousand jobs running, as on a fleet of GPU hosts
        taken += await manager.claim(**CLAIM, budgets={0: 10**7}, limit=100)
    async with engine.begin() as conn:
        await conn.execute(text("ANALYZE jobs"))
    job = taken[0].job

    async def finish() -> None:
        with pytest.raises(errors.LeaseLost):  # the explained success was rolled back
            await manager.succeed(job, [], {})

    for report in await both_plans(engine, monkeypatch, finish):
        assert plans.rows_read(report["Plan"], "jobs") <= 2, report["Plan"]
    await manager.succeed(job, [], {})
    assert (await manager.get(job.id)).state is JobState.succeeded


async def claim_statements(engine: Any) -> list[int]:
    """How many jobs each claim statement took (a statement's rows share its `started_at`)."""
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT count(*) FROM jobs GROUP BY started_at ORDER BY started_at"))
        return [int(n) for (n,) in rows]


async def test_a_worker_with_free_slots_claims_them_in_one_statement(manager, engine, make_worker):
    for _ in range(6):
        await enqueue(manager, sleep=0.3)
    await make_worker(max_jobs_per_gpu=8).run()
    assert await claim_statements(engine) == [6]


async def test_claim_batch_bounds_a_statement(manager: JobManager, engine, make_worker):
    for _ in range(6):
        await enqueue(manager, sleep=0.3)
    await make_worker(max_jobs_per_gpu=8, claim_batch=2).run()
    assert await claim_statements(engine) == [2, 2, 2]


async def test_no_transaction_stays_open_while_models_run(manager: JobManager, make_worker, engine):
    """Every write is one short autocommit statement: while jobs run (claimed, pids recorded,
    progress and heartbeats written), no connection of the worker sits idle inside a transaction."""
    # Jobs long enough that 1.5 s of sampling fits inside them on a slow machine; no grace at
    # stop, so leaving the block does not wait for them.
    ids = [await enqueue(manager, sleep=4.0, steps=8) for _ in range(2)]
    seen: list[int] = []
    async with running(make_worker(burst=False, shutdown_grace_s=0)):
        deadline = asyncio.get_running_loop().time() + 10
        while [(await manager.get(i)).state for i in ids] != [JobState.running] * 2:
            assert asyncio.get_running_loop().time() < deadline, "the jobs did not start"
            await asyncio.sleep(0.05)
        for _ in range(15):  # across the pid records (0.5 s) and progress lines
            async with engine.connect() as conn:
                seen.append(int(await conn.scalar(IDLE_IN_TRANSACTION)))
            await asyncio.sleep(0.1)
        assert [(await manager.get(i)).state for i in ids] == [JobState.running] * 2  # still running
    assert seen == [0] * 15


IDLE_IN_TRANSACTION = text(
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
)


async def test_one_heartbeat_renews_every_lease_the_worker_holds(manager: JobManager, engine):
    for _ in range(4):
        await enqueue(manager)
    mine = [c.job for c in await manager.claim(**CLAIM, budgets={0: 10_000}, limit=3)]
    other = (await manager.claim(**{**CLAIM, "worker_id": "test:other"}, budgets={0: 10_000}))[0].job
    assert len(mine) == 3
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE jobs SET lease_expires_at = now() + interval '1 second'"))
    beat = await manager.heartbeat(
        worker_id="test:w", job_ids=[j.id for j in [*mine, other]], lease_s=60, gpus=[]
    )
    assert beat.owned == {j.id: (1, False) for j in mine}  # not the other worker's job
    async with engine.connect() as conn:
        renewed = text("SELECT id, lease_expires_at > now() + interval '30 seconds' FROM jobs")
        leases = dict((await conn.execute(renewed)).all())
    assert leases == {**{j.id: True for j in mine}, other.id: False}


async def test_heartbeats_and_successes_of_the_same_jobs_do_not_deadlock(manager: JobManager):
    """A heartbeat and a batch of successes each lock several of the worker's running jobs. In
    orders of their own they deadlocked within seconds under load: PostgreSQL failed one of
    them, and the worker stopped (a deadlock is no outage to ride out). Both lock in id order."""
    await enqueue(manager, vram_mb=1)
    async with manager._engine.begin() as conn:
        await conn.execute(plans.QUEUED_BESIDE, {"count": 299})
    jobs: list[Any] = []
    while batch := await manager.claim(**CLAIM, budgets={0: 10**6}, limit=100):
        jobs += [c.job for c in batch]
    assert len(jobs) == 300
    ids = [j.id for j in jobs]
    ended = asyncio.Event()

    async def beat() -> None:
        while not ended.is_set():
            await manager.heartbeat(worker_id="test:w", job_ids=ids, lease_s=60, gpus=[])

    async def finish() -> None:
        try:  # successes reported in another order than the jobs' ids (batches of 64)
            await asyncio.gather(*(manager.succeed(j, [], {}) for j in reversed(jobs)))
        finally:
            ended.set()

    await asyncio.gather(beat(), beat(), finish())
    assert {(await manager.get(i)).state for i in ids} == {JobState.succeeded}


async def test_slots_freed_close_together_are_filled_by_one_claim(manager: JobManager, make_worker):
    async def run(gather_s: float) -> tuple[Any, Any]:
        # Three slots: the priority-5 jobs start first; two end 0.6 s apart while the third
        # runs on; the next two jobs wait for those slots. (At 0.3 s apart, the test needed a
        # rerun once in a full run.)
        first = [await enqueue(manager, priority=5, sleep=s, steps=1) for s in (0.2, 0.8, 3.0)]
        then = [await enqueue(manager, priority=0, steps=0) for _ in range(2)]
        await make_worker(max_jobs_per_gpu=3, claim_gather_s=gather_s).run()
        done = [await manager.get(i) for i in (*first, *then)]
        assert all(j.state is JobState.succeeded for j in done), done
        return done[3].started_at, done[4].started_at

    apart = await run(0.0)
    assert apart[0] != apart[1]  # claimed as each slot freed: two statements
    together = await run(1.5)
    assert together[0] == together[1]  # one statement (now() is its transaction's time) for both


LISTENING = text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = :listen"
)


async def test_an_idle_worker_is_woken_by_the_enqueue_not_by_its_poll(
    manager: JobManager, make_worker, engine
):
    """A listening worker that polls only every 60 s starts a job queued through the manager at once:
    the enqueue's NOTIFY wakes it (bench_throughput's section 2 measures how fast)."""
    worker = make_worker(burst=False, poll_interval_s=60.0, reap_interval_s=60.0)
    async with running(worker):
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # both LISTENs sent (the cancel channel's comes second) and the first claim made
            async with engine.connect() as conn:
                listening = await conn.scalar(LISTENING, {"listen": f'LISTEN "{sql.CANCEL_CHANNEL}"'})
            if listening:
                break
            assert asyncio.get_running_loop().time() < deadline, "the worker never listened"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # past the claim its LISTEN triggers, which found nothing
        job_id = await enqueue(manager)
        job = await until(manager, job_id, lambda j: j.state is JobState.succeeded, timeout_s=10)
    assert job.started_at is not None and (job.started_at - job.created_at).total_seconds() < 2


async def test_a_model_warm_only_on_a_gpu_this_claim_cannot_use_is_not_preferred(manager: JobManager):
    """docs/persistent.md: among equals the claim prefers a job whose model has a live runner on
    that GPU. It preferred the model wherever its runner was: a newer job of a model warm only on
    a full GPU went ahead of an older one, and then ran cold on another GPU."""
    older = await enqueue(manager, model="cold")
    newer = await enqueue(manager, model="warm")
    claim = {**CLAIM, "models": ["cold", "warm"], "limit": 1}
    [taken] = await manager.claim(**claim, budgets={0: 10_000}, warm={("warm", 1)})  # GPU 1 is full
    assert taken.job.id == older
    [taken] = await manager.claim(**claim, budgets={0: 10_000, 1: 10_000}, warm={("warm", 1)})
    assert (taken.job.id, taken.job.gpu) == (newer, 1)  # warm where there is room: first, and there


async def test_a_model_warm_on_a_gpu_too_small_for_the_job_is_not_preferred(manager: JobManager):
    """The same when the runner's GPU has room, but not enough for this job."""
    older = await enqueue(manager, model="cold", vram_mb=3000)
    await enqueue(manager, model="warm", vram_mb=3000)
    claim = {**CLAIM, "models": ["cold", "warm"], "limit": 1, "warm": {("warm", 1)}}
    [taken] = await manager.claim(**claim, budgets={0: 10_000, 1: 2000})
    assert (taken.job.id, taken.job.gpu) == (older, 0)


async def test_due_retries_are_promoted_without_reading_the_jobs_done(manager: JobManager, engine):
    """Every worker's reaper promotes the due retries every few seconds. The planner expects most
    scheduled jobs to be due (the `run_after` of finished jobs lies in the past) and read the whole
    table to join them: a sequential scan of 20,000 jobs (4 ms; 20 ms at 120,000) per round while
    any retry was due. Checked on the custom and the generic plan."""
    await enqueue(manager)
    async with engine.begin() as conn:
        await conn.execute(plans.FINISHED_BESIDE, {"count": 20_000})
        await conn.execute(
            text(
                "UPDATE jobs SET state = 'scheduled', finished_at = NULL, run_after = now() + "
                "CASE WHEN id IN (SELECT id FROM jobs ORDER BY id LIMIT 5) THEN interval '-1 minute' "
                "ELSE interval '1 hour' END "
                "WHERE id IN (SELECT id FROM jobs WHERE state = 'succeeded' ORDER BY id LIMIT 400)"
            )
        )
        await conn.execute(text("ANALYZE jobs"))
    for mode in ("force_custom_plan", "force_generic_plan"):
        reports = await plans.prepared_reports(engine, sql.PROMOTE_DUE, {}, mode)
        assert len(reports) == 1, reports
        plan = reports[0]["Plan"]
        assert "Seq Scan" not in plans.scans_of(plan, "jobs"), plan
        updated = [n for n in plans.nodes(plan) if n["Node Type"] == "ModifyTable"]
        assert [n["Actual Rows"] for n in updated] == [5], plan
    assert await manager.promote_due() == 5
