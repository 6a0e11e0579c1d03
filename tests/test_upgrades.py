"""Upgrades in place: a database of every older revision, holding jobs in every state, migrated to
head (and back down), keeps them all, and the service then runs and recovers them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from alembic import command
from sqlalchemy import text

from app import db, migrate
from app.queue.jobs import JobState
from app.queue.manager import JobManager
from tests.conftest import png_bytes
from tests.test_migrations import _diff, empty_database

TOY_DEFAULTS = {
    "sleep": 0,
    "steps": 2,
    "exit_code": 0,
    "fail_attempts": 0,
    "signal": "none",
    "oom_attempts": 0,
    "noise_kb": 0,
    "output": True,
    "trace": "none",
}
RESULTS = json.dumps([{"name": "out.txt", "bytes": 5, "sha256": "ab", "media_type": "text/plain"}])
OLDER = sorted(migrate.known() - {migrate.head()})
# Every state each revision has: 0003 added `scheduled` and `quarantined`.
FIRST_STATES = ("queued", "running", "succeeded", "failed", "canceled")
LATER_STATES = ("scheduled", "quarantined")


async def _fill(url: str, revision: str) -> dict[str, Any]:
    """Jobs in every state `revision` has, each with its events, a gone worker and an input: what
    the schema then holds, in the columns every revision has."""
    conn = await asyncpg.connect(db.asyncpg_dsn(url))
    try:
        image = png_bytes()
        input_id = await conn.fetchval(
            "INSERT INTO inputs (sha256, media_type, width, height, bytes, data)"
            " VALUES ($1, 'image/png', 64, 48, $2, $3) RETURNING id",
            hashlib.sha256(image).hexdigest(), len(image), image,
        )  # fmt: skip
        await conn.execute(
            "INSERT INTO workers (id, host, pid, heartbeat_at) VALUES"
            " ('gone-host:worker', 'gone-host', 4242, now() - interval '1 hour')"
        )
        states = FIRST_STATES + (LATER_STATES if revision >= "0003" else ())
        for state in states:
            running = state == "running"
            finished = state in ("succeeded", "failed", "canceled", "quarantined")
            job = await conn.fetchval(
                "INSERT INTO jobs (model, params, input_id, megapixels, vram_mb, max_attempts, state,"
                " attempt, run_after, lease_expires_at, worker_id, host, gpu, pid, started_at,"
                " finished_at, error, results, idempotency_key, owner)"
                " VALUES ('toy', $1, $2, 0.003, 1000, 3, $3::text::job_state, $4,"
                " now() + CASE WHEN $3 = 'scheduled' THEN interval '1 hour' ELSE interval '0' END,"
                " CASE WHEN $5 THEN now() - interval '1 hour' END,"
                " CASE WHEN $5 THEN 'gone-host:worker' END, CASE WHEN $5 THEN 'gone-host' END,"
                " CASE WHEN $5 THEN 0 END, CASE WHEN $5 THEN 999999 END,"
                " CASE WHEN $5 OR $6 THEN now() - interval '2 hours' END,"
                " CASE WHEN $6 THEN now() - interval '1 hour' END,"
                " CASE WHEN $3 IN ('failed', 'quarantined') THEN 'exit code 3' END,"
                " CASE WHEN $3 = 'succeeded' THEN $7::jsonb ELSE '[]'::jsonb END, 'key-' || $3, 'alice')"
                " RETURNING id",
                json.dumps(TOY_DEFAULTS), input_id, state, 1 if running or finished else 0, running, finished,
                RESULTS,
            )  # fmt: skip
            await conn.execute(
                "INSERT INTO job_events (job_id, kind, attempt, worker_id, detail)"
                " VALUES ($1, 'submitted', 0, NULL, '{}'),"
                " ($1, 'noted', 1, 'gone-host:worker', '{\"n\": 1}')",
                job,
            )
        return await _held(conn)
    finally:
        await conn.close()


async def _held(conn: asyncpg.Connection) -> dict[str, Any]:
    """What must survive an upgrade: each job's state, attempt, results and events."""
    jobs = await conn.fetch(
        "SELECT id, state::text AS state, attempt, results::text AS results, error, idempotency_key,"
        " (SELECT count(*) FROM job_events e WHERE e.job_id = j.id) AS events FROM jobs j ORDER BY id"
    )
    return {str(r["id"]): dict(r) for r in jobs}


@pytest.mark.parametrize("revision", OLDER)
async def test_an_upgrade_from_every_older_revision_keeps_every_job_and_runs_them(
    server_url, template_db, make_worker, revision
):
    async with empty_database(server_url) as url:
        await asyncio.to_thread(migrate.upgrade, url, revision)
        before = await _fill(url, revision)
        await asyncio.to_thread(migrate.upgrade, url)
        assert await _diff(url) == []
        conn = await asyncpg.connect(db.asyncpg_dsn(url))
        try:
            assert await _held(conn) == before
        finally:
            await conn.close()

        engine = db.create_engine(url, pool_size=2)
        try:
            manager = JobManager(engine)
            by_state = {v["state"]: k for k, v in before.items()}
            taken = await manager.fleet.recover_expired(by_worker="test:upgrader")
            assert [str(t.id) for t in taken] == [by_state["running"]]
            await make_worker(manager_=manager).run()
            for state, job_id in by_state.items():
                job = await manager.get(uuid.UUID(job_id))
                expected = {"queued": JobState.succeeded, "running": JobState.succeeded}.get(
                    state, JobState(state)
                )
                assert job.state is expected, (state, job.state, job.error)
        finally:
            await engine.dispose()


@pytest.mark.parametrize("revision", OLDER)
async def test_a_downgrade_to_every_older_revision_keeps_every_job(server_url, revision):
    """docs/operations.md: a schema ahead of the code is taken back with `alembic downgrade
    <revision>` from the newer release's checkout."""
    async with empty_database(server_url) as url:
        await asyncio.to_thread(migrate.upgrade, url)
        before = await _fill(url, migrate.head() or "")
        await asyncio.to_thread(migrate.downgrade, url, revision)
        conn = await asyncpg.connect(db.asyncpg_dsn(url))
        try:
            after = await _held(conn)
        finally:
            await conn.close()
        older = {"scheduled": "queued", "quarantined": "failed"} if revision < "0003" else {}
        assert after == {k: {**v, "state": older.get(v["state"], v["state"])} for k, v in before.items()}
        await asyncio.to_thread(migrate.upgrade, url)
        assert await _diff(url) == []


async def test_a_worker_started_while_a_migration_runs_waits_for_it(settings, engine):
    """A new release's `gpujobs migrate` runs (it holds the migration lock) and its worker starts
    meanwhile, as a supervisor or an orchestrator starts it: the worker read the schema half-way
    and stopped, exit 2, saying to run `gpujobs migrate`, the very command that was running."""
    from tests.conftest import worker_env
    from tests.integration.test_client import run_cli

    url = settings.database_url
    assert url
    await asyncio.to_thread(migrate.downgrade, url, "-1")
    lock = {"key": migrate.MIGRATE_LOCK_KEY}

    def upgrade(connection: Any) -> None:  # alembic on the connection that holds the lock
        config = migrate.alembic_config(url)
        config.attributes["connection"] = connection
        command.upgrade(config, "head")

    async with engine.connect() as migrating:
        await migrating.execute(text("SELECT pg_advisory_lock(:key)"), lock)
        await migrating.commit()
        started = asyncio.ensure_future(run_cli(worker_env(settings, "during"), "worker", "--burst"))
        await asyncio.sleep(3)  # the worker starts, and finds the migration under way
        await migrating.run_sync(upgrade)
        await migrating.execute(text("SELECT pg_advisory_unlock(:key)"), lock)
        await migrating.commit()
    code, _, stderr = await started
    assert "run `gpujobs migrate`" not in stderr, stderr[-2000:]
    assert code == 0, stderr[-2000:]


NEWER_RELEASE = """
revision = "0010"
down_revision = "{head}"
{declared}

from alembic import op
import sqlalchemy as sa


def upgrade():
    op.add_column("jobs", sa.Column("newer_release_note", sa.Text(), nullable=True))


def downgrade():
    op.drop_column("jobs", "newer_release_note")
"""


def newer_release(tmp_path: Path, url: str, oldest_code: str | None) -> Any:
    """The Alembic configuration of a newer release: the checkout's migrations and one more, which
    adds a nullable column (as 0008 and 0009 did) and declares `oldest_code` (or nothing)."""
    scripts = tmp_path / "newer" / "migrations"
    shutil.copytree(migrate.VERSIONS.parent, scripts, ignore=shutil.ignore_patterns("__pycache__"))
    declared = f'oldest_code = "{oldest_code}"' if oldest_code else ""
    text_ = NEWER_RELEASE.format(head=migrate.head(), declared=declared)
    (scripts / "versions" / "20261201_0010_newer.py").write_text(text_)
    config = migrate.alembic_config(url)
    config.set_main_option("script_location", str(scripts))
    return config


async def test_an_api_stays_ready_while_a_newer_release_that_only_adds_migrates(settings, png, tmp_path):
    """A rolling upgrade: the new release's `gpujobs migrate` adds a nullable column while the old
    API processes serve, and its migration declares that the code before it runs on what it made.
    Every old API answered 503 on /readyz the moment the migration committed, so the load
    balancer took all of them out at once, before any new API process was up; and an old worker
    (re)started meanwhile refused the schema."""
    from tests.conftest import api_client, worker_env
    from tests.integration.test_client import run_cli

    url = settings.database_url
    assert url
    async with api_client(settings) as http:
        assert (await http.get("/readyz")).status_code == 200
        await asyncio.to_thread(command.upgrade, newer_release(tmp_path, url, migrate.head()), "head")
        files = {"image": ("a.png", png(), "image/png")}
        created = await http.post("/jobs", files=files, data={"model": "toy"})
        assert created.status_code == 201, created.text  # it serves the newer schema
        ready = await http.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["schema"] == {
            "current": "0010",
            "head": migrate.head(),
            "oldest_code": migrate.head(),
        }
        code, _, stderr = await run_cli(worker_env(settings, "old"), "worker", "--burst")
        assert code == 0, stderr[-2000:]
        assert (await http.get(f"/jobs/{created.json()['id']}")).json()["state"] == "succeeded"
        code, stdout, stderr = await run_cli(worker_env(settings, "old"), "migrate")
        assert code == 0, stderr[-2000:]
        assert (
            f"database at revision 0010 (ahead of this code's {migrate.head()}, which runs on it)" in stdout
        )


async def test_an_api_is_unready_under_a_newer_release_that_declares_nothing(settings, tmp_path):
    """A migration that does not say the code before it runs on its schema: the old API cannot
    know, and leaves the load balancer (503), as before."""
    from tests.conftest import api_client

    url = settings.database_url
    assert url
    async with api_client(settings) as http:
        await asyncio.to_thread(command.upgrade, newer_release(tmp_path, url, None), "head")
        ready = await http.get("/readyz")
        assert ready.status_code == 503 and "which this version of gpujobs does not know" in ready.text
        assert ready.json()["schema"]["oldest_code"] == "0010"


async def test_every_migration_records_the_oldest_code_that_runs_on_its_schema(server_url):
    """The record (the comment on alembic_version) is written in each migration's transaction, up
    and down; the checkout's migrations declare nothing, so each one's record is itself."""
    async with empty_database(server_url) as url:
        engine = db.create_engine(url, pool_size=1)
        try:
            for revision in (migrate.head(), "0007", migrate.head()):
                await asyncio.to_thread(
                    migrate.upgrade if revision == migrate.head() else migrate.downgrade, url, revision
                )
                assert await migrate.schema(engine) == migrate.Schema(revision, revision)
        finally:
            await engine.dispose()


def test_a_migration_that_declares_a_later_oldest_code_is_refused(tmp_path):
    config = newer_release(tmp_path, "", "0011")
    from alembic.script import ScriptDirectory

    from app import errors

    with pytest.raises(errors.ConfigError, match="declares oldest_code = '0011', which is not a revision"):
        migrate.oldest_code("0010", ScriptDirectory.from_config(config))
    assert migrate.oldest_code("0009", ScriptDirectory.from_config(config)) == "0009"


async def test_migrate_into_another_applications_alembic_database_says_whose_it_is(server_url):
    """GPUJOBS_DATABASE_URL pointed at another application's database, which Alembic manages too:
    `gpujobs migrate` said "a newer release migrated it; run that release, or downgrade the
    database to 0009 with it first", advice that fits no database of that application."""
    from app import errors

    async with empty_database(server_url) as url:
        conn = await asyncpg.connect(db.asyncpg_dsn(url))
        try:
            await conn.execute("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)")
            await conn.execute("INSERT INTO alembic_version VALUES ('3f2a9c1b7d40')")
            await conn.execute("CREATE TABLE invoices (id int)")
        finally:
            await conn.close()
        with pytest.raises(errors.ConfigError) as raised:
            await asyncio.to_thread(migrate.upgrade, url)
        message = raised.value.message
        assert "newer release" not in message and "downgrade" not in message, message
        assert "3f2a9c1b7d40" in message and "no table of gpujobs" in message, message


CONCURRENT_INDEX = """
revision = "0010"
down_revision = "{head}"
oldest_code = "{head}"

from alembic import op


def upgrade():
    op.execute("SELECT pg_sleep(2)")  # a slower migration: a process starts meanwhile
    with op.get_context().autocommit_block():
        op.create_index("jobs_newer_idx", "jobs", ["model", "created_at"], postgresql_concurrently=True)


def downgrade():
    op.drop_index("jobs_newer_idx", table_name="jobs")
"""


def _release(tmp_path: Path, url: str, script: str) -> Any:
    """A newer release's Alembic configuration: the checkout's migrations and `script`."""
    scripts = tmp_path / "newer" / "migrations"
    shutil.copytree(migrate.VERSIONS.parent, scripts, ignore=shutil.ignore_patterns("__pycache__"))
    (scripts / "versions" / "20261201_0010_newer.py").write_text(script.format(head=migrate.head()))
    config = migrate.alembic_config(url)
    config.set_main_option("script_location", str(scripts))
    return config


async def test_a_process_waiting_for_a_migration_does_not_deadlock_its_concurrent_index(server_url, tmp_path):
    """docs/operations.md recommends "an index built without blocking writes" as a migration older
    code runs on. CREATE INDEX CONCURRENTLY waits for every transaction with an older snapshot; a
    worker started meanwhile waits for the migration lock (migrate.in_turn) inside a statement,
    holding a snapshot: each waits for the other, and PostgreSQL ends one with "deadlock detected"."""
    async with empty_database(server_url) as url:
        await asyncio.to_thread(migrate.upgrade, url)
        config = _release(tmp_path, url, CONCURRENT_INDEX)
        migrating = asyncio.ensure_future(asyncio.to_thread(command.upgrade, config, "head"))
        await asyncio.sleep(1)  # the migration holds the lock, in its pg_sleep

        async def starting() -> migrate.Schema:  # as cli._schema_at, at a worker's start
            engine = db.create_engine(url, pool_size=1)
            try:
                async with migrate.in_turn(engine):
                    return await migrate.schema(engine)
            finally:
                await engine.dispose()

        found = await asyncio.wait_for(starting(), 60)
        await asyncio.wait_for(migrating, 60)
        assert found == migrate.Schema("0010", migrate.head())


async def test_a_migration_applied_as_sql_records_the_oldest_code(server_url, tmp_path):
    """A DBA reviews and applies the SQL of `alembic upgrade <from>:head --sql` (offline mode, which
    migrations/env.py supports): the revision changed and the record did not, so every older API
    answered 503 on /readyz although the migration declares that their code runs on its schema."""
    import io

    import asyncpg

    from tests.test_upgrades import newer_release

    async with empty_database(server_url) as url:
        await asyncio.to_thread(migrate.upgrade, url)
        config = newer_release(tmp_path, url, migrate.head())
        config.output_buffer = io.StringIO()
        command.upgrade(config, f"{migrate.head()}:head", sql=True)
        conn = await asyncpg.connect(db.asyncpg_dsn(url))
        try:
            await conn.execute(config.output_buffer.getvalue())
        finally:
            await conn.close()
        engine = db.create_engine(url, pool_size=1)
        try:
            assert await migrate.schema(engine) == migrate.Schema("0010", migrate.head())
        finally:
            await engine.dispose()


async def test_a_second_alembic_upgrade_does_not_deadlock_a_concurrent_index(server_url, tmp_path):
    """The same through migrations/env.py's own wait: `alembic upgrade head` from the checkout (or
    a second `gpujobs migrate` that passed its check first) waited for the lock inside a statement."""
    async with empty_database(server_url) as url:
        await asyncio.to_thread(migrate.upgrade, url)
        config = _release(tmp_path, url, CONCURRENT_INDEX)
        migrating = asyncio.ensure_future(asyncio.to_thread(command.upgrade, config, "head"))
        await asyncio.sleep(1)
        code = (
            "import sys; from alembic import command; from app import migrate;"
            " config = migrate.alembic_config(sys.argv[1]);"
            " config.set_main_option('script_location', sys.argv[2]); command.upgrade(config, 'head')"
        )
        scripts = config.get_main_option("script_location")
        second = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, url, scripts,
            cwd=migrate.checkout.ROOT, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await asyncio.wait_for(second.communicate(), 60)
        assert second.returncode == 0, stderr.decode()[-2000:]
        await asyncio.wait_for(migrating, 60)
        engine = db.create_engine(url, pool_size=1)
        try:
            assert await migrate.schema(engine) == migrate.Schema("0010", migrate.head())
        finally:
            await engine.dispose()


async def test_a_process_waiting_for_a_hung_migration_says_so_again_and_names_it(engine, caplog, monkeypatch):
    """A migration that hangs (its host gone without closing the connection: the server keeps its
    session, and the lock, until TCP keepalive gives up, two hours by default): `serve`, `worker`
    and `keys` said once that a migration was under way, then waited without another word, and
    nothing said which process held the lock."""
    from sqlalchemy import text

    monkeypatch.setattr(migrate, "LOCK_REMIND_S", 1.0)
    key = {"key": migrate.MIGRATE_LOCK_KEY}
    async with engine.connect() as migrating:
        await migrating.execute(text("SELECT pg_advisory_lock(:key)"), key)
        await migrating.commit()
        pid = await migrating.scalar(text("SELECT pg_backend_pid()"))

        async def starting() -> None:
            async with migrate.in_turn(engine):
                pass

        waiting = asyncio.ensure_future(starting())
        await asyncio.sleep(2.8)
        await migrating.execute(text("SELECT pg_advisory_unlock(:key)"), key)
        await migrating.commit()
        await asyncio.wait_for(waiting, 10)
    said = [r.getMessage() for r in caplog.records if getattr(r, "action", None) == "migration_wait"]
    assert len(said) >= 2, said
    assert f"held by PostgreSQL process {pid}, gpujobs" in said[-1], said


async def test_a_stamp_by_a_role_that_does_not_own_alembic_version_stands_without_a_record(settings):
    """Only alembic_version's owner may comment on it: a stamp by a role with rights on its rows
    alone failed whole ("must be owner of table alembic_version") once each run wrote the record.
    It stands now, without a record: older code refuses the schema, as with none."""
    from sqlalchemy.engine import make_url

    from tests import dbadmin

    role = f"gj_stamper_{uuid.uuid4().hex[:8]}"
    url = settings.database_url or ""
    await dbadmin.admin(
        url,
        f"CREATE ROLE {role} LOGIN PASSWORD 'pw'",
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON alembic_version TO {role}",
    )
    try:
        as_role = make_url(url).set(username=role, password="pw").render_as_string(hide_password=False)
        await asyncio.to_thread(command.stamp, migrate.alembic_config(as_role), "0008")
        engine = db.create_engine(url, pool_size=1)
        try:
            assert await migrate.schema(engine) == migrate.Schema("0008", None)
        finally:
            await engine.dispose()
    finally:
        await dbadmin.admin(url, f"DROP OWNED BY {role}", f"DROP ROLE {role}")
