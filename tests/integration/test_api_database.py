"""The API while PostgreSQL is slow (every connection of the pool is taken and none comes free),
out of disk space, and once it is back after a restart."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from sqlalchemy import exc, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from app import auth, db
from app.queue.manager import JobManager
from tests import dbadmin
from tests.conftest import api_client, png_bytes
from tests.integration.test_retention_races import until_waiting
from tests.integration.test_worker import enqueue


def one_connection(settings):
    """An engine of one connection that a request waits half a second for, at most (the service's
    own holds 20 and waits 30 s: the same thing, slower)."""
    return create_async_engine(settings.database_url, pool_size=1, max_overflow=0, pool_timeout=0.5)


async def test_a_key_check_that_finds_no_free_connection_is_503(settings, engine):
    """The key check waited for a pooled connection while all were busy (PostgreSQL slow, or a lock
    held) and gave up after the pool's timeout: a 500 with a traceback in the log. Now 503 with
    Retry-After, as for a database that is down."""
    small = one_connection(settings)
    async with api_client(settings) as http, engine.connect() as holder:
        http.app.state.services.keys = auth.KeyStore(small)
        await holder.execute(
            text("UPDATE api_keys SET last_used_at = :old"), {"old": datetime.now(UTC) - timedelta(hours=1)}
        )
        await holder.commit()
        await holder.execute(text("SELECT 1 FROM api_keys FOR UPDATE"))  # the key check's update waits
        first = asyncio.create_task(http.get("/jobs"))  # holds the one connection, waiting
        await until_waiting(engine, 1, first)
        second = await http.get("/jobs")
        assert second.status_code == 503, second.text
        assert second.headers["retry-after"] and "busy" in second.json()["detail"]
        await holder.rollback()
        assert (await first).status_code == 200
    await small.dispose()


async def test_a_route_that_finds_no_free_connection_is_503(settings, engine, manager):
    """The same for a route's own statements, past the key check."""
    job_id = await enqueue(manager)
    small = one_connection(settings)
    async with api_client(settings) as http, engine.connect() as holder:
        http.app.state.services.manager = JobManager(small)
        await holder.execute(text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE"), {"id": job_id})
        cancel = asyncio.create_task(http.post(f"/jobs/{job_id}/cancel"))  # waits on the row lock
        await until_waiting(engine, 1, cancel)
        read = await http.get(f"/jobs/{job_id}")
        assert read.status_code == 503, read.text
        assert read.headers["retry-after"] and "busy" in read.json()["detail"]
        await holder.rollback()
        assert (await cancel).json()["state"] == "canceled"
    await small.dispose()


async def test_pooled_connections_the_server_closed_fail_no_request(settings, server_url, manager):
    """PostgreSQL restarted (here: every connection to the test database ended, as a restart ends
    them): each connection left in the pool failed the request that took it, a 503 for a database
    that was back, until every one had been used. The pool now connects afresh at once."""
    job_id = await enqueue(manager)
    async with api_client(settings) as http:
        await asyncio.gather(*(http.get(f"/jobs/{job_id}") for _ in range(8)))  # 8 connections pooled
        name = make_url(settings.database_url).database
        await dbadmin.admin(
            server_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            f" WHERE datname = '{name}' AND pid <> pg_backend_pid()",
        )
        await asyncio.sleep(0.2)  # the API's connections see the server close them
        answers = [(await http.get(f"/jobs/{job_id}")).status_code for _ in range(10)]
    assert answers == [200] * 10


async def test_an_upload_while_the_database_disk_is_full_is_a_clear_503(settings, engine):
    """What PostgreSQL says when its disk is full (SQLSTATE 53100, `could not extend file ...: No
    space left on device`), raised here by a trigger on the insert of the upload's image, so the
    driver gets the very error class a full disk gives (asyncpg.exceptions.DiskFullError). It was a
    bare `500 Internal Server Error` (text/plain), logged as `http_error` with a traceback."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " RAISE EXCEPTION 'could not extend file \"base/5/16403\": No space left on device'"
                " USING ERRCODE = 'disk_full', HINT = 'Check free disk space.'; END $$"
            )
        )
        await conn.execute(
            text("CREATE TRIGGER disk_full BEFORE INSERT ON inputs FOR EACH ROW EXECUTE FUNCTION disk_full()")
        )
    async with api_client(settings) as http:
        answer = await http.post(
            "/jobs",
            files={"image": ("photo.png", png_bytes(color=(7, 8, 9)), "image/png")},
            data={"model": "toy", "params": json.dumps({})},
        )
    async with engine.connect() as conn:
        jobs = (await conn.execute(text("SELECT count(*) FROM jobs"))).scalar_one()
    assert jobs == 0, "nothing half-written"
    assert answer.status_code == 503, (answer.status_code, answer.headers.get("content-type"), answer.text)
    assert int(answer.headers["retry-after"]) > 0
    assert "out of disk space" in answer.json()["detail"], answer.json()


def wrapped(error: asyncpg.PostgresError) -> exc.DBAPIError:
    """`error` as SQLAlchemy raises it: in its DBAPIError, around the dialect's own error."""
    dialect_error = Exception(str(error))
    dialect_error.__cause__ = error
    return exc.DBAPIError("INSERT ...", {}, dialect_error)


@pytest.mark.parametrize(
    "error, passing",
    [
        (asyncpg.InsufficientResourcesError("53000"), True),
        (asyncpg.DiskFullError("could not extend file"), True),
        (asyncpg.OutOfMemoryError("out of memory"), True),
        (asyncpg.TooManyConnectionsError("too many clients"), True),
        # A statement over a configured limit fails again when sent again: not passing.
        (asyncpg.ConfigurationLimitExceededError("too many range table entries"), False),
    ],
)
def test_postgresql_short_of_a_resource_is_passing_trouble(error, passing):
    """SQLSTATE class 53 but 53400, bare or wrapped, is the database unavailable for now (a 503,
    workers retry their writes), not a client's error nor a job's."""
    assert db.is_unavailable(error) is passing
    assert db.is_unavailable(wrapped(error)) is passing
