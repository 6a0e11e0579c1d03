"""The API while PostgreSQL is slow (every connection of the pool is taken and none comes free),
and once it is back after a restart."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from app import auth
from app.queue.manager import JobManager
from tests import dbadmin
from tests.conftest import api_client
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
