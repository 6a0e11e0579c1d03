"""Schema: Alembic upgrades an empty database to head, downgrades to base, and matches the tables."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import create_async_engine

from app import db, errors, migrate, tables
from tests import dbadmin
from tests.conftest import _with_database


async def _table_names(url: str) -> set[str]:
    conn = await asyncpg.connect(db.asyncpg_dsn(url))
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        types = await conn.fetch("SELECT typname FROM pg_type WHERE typname = 'job_state'")
    finally:
        await conn.close()
    return {r["tablename"] for r in rows} | {r["typname"] for r in types}


async def _diff(url: str) -> list[object]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(
                lambda sync: compare_metadata(MigrationContext.configure(sync), tables.Base.metadata)
            )
    finally:
        await engine.dispose()


@contextlib.asynccontextmanager
async def empty_database(server_url: str) -> AsyncIterator[str]:
    """A new, empty database on the test server (dropped afterwards): its URL."""
    name = f"gpujobs_mig_{uuid.uuid4().hex[:8]}"
    await dbadmin.admin(server_url, f"CREATE DATABASE {name}")
    try:
        yield _with_database(server_url, name)
    finally:
        await dbadmin.admin(server_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def test_upgrade_downgrade_and_no_difference(server_url):
    async with empty_database(server_url) as url:
        engine = db.create_engine(url, pool_size=1)
        assert await migrate.current(engine) is None  # never migrated: no alembic_version table
        await asyncio.to_thread(migrate.upgrade, url)
        expected = {"inputs", "jobs", "job_events", "workers", "api_keys", "alembic_version", "job_state"}
        assert expected <= await _table_names(url)
        assert await _diff(url) == []  # autogenerate finds nothing: models and migrations agree
        assert await migrate.current(engine) == migrate.head()

        await asyncio.to_thread(migrate.downgrade, url, "base")
        assert await _table_names(url) == {"alembic_version"}
        assert await migrate.current(engine) is None  # the table is there, empty
        await engine.dispose()
        await asyncio.to_thread(migrate.upgrade, url)  # and back up again from base
        assert await _diff(url) == []


def test_the_head_read_from_the_scripts_is_alembics(tmp_path, monkeypatch):
    alembics = ScriptDirectory.from_config(migrate.alembic_config("")).get_current_head()
    assert alembics is not None and migrate.head() == alembics

    chain = {"b_second.py": ("'b'", '"a"'), "a_first.py": ('"a"', "None"), "c_third.py": ('"c"', "'b'")}
    for name, (revision, parent) in chain.items():
        (tmp_path / name).write_text(f"revision: str = {revision}\ndown_revision: str | None = {parent}\n")
    monkeypatch.setattr(migrate, "VERSIONS", tmp_path)
    monkeypatch.setattr(migrate, "_alembic_head", lambda: "asked alembic")
    assert migrate.head() == "c"

    (tmp_path / "d_merge.py").write_text('revision = "d"\ndown_revision = ("b", "c")\n')
    assert migrate.head() == "asked alembic"  # a merge: read by Alembic, not by the pattern
    (tmp_path / "d_merge.py").write_text('revision = "d"\ndown_revision = "b"\n')
    assert migrate.head() == "asked alembic"  # two heads (c and d): Alembic says what is wrong


def test_an_install_without_the_migration_scripts_says_how_to_install(tmp_path, monkeypatch):
    """`pip install .` (not -e) leaves migrations/ and alembic.ini out of the wheel: every start
    died on Alembic's "CommandError: Path doesn't exist", which did not say what to do."""
    monkeypatch.setattr(migrate, "VERSIONS", tmp_path / "migrations" / "versions")
    for call in (migrate.head, migrate.known, lambda: migrate.alembic_config("")):
        with pytest.raises(errors.ConfigError, match=r"pip install -e \.` in a checkout"):
            call()


async def _storage_of_input_data(url: str) -> str:
    conn = await asyncpg.connect(db.asyncpg_dsn(url))
    try:
        query = "SELECT attstorage::text FROM pg_attribute WHERE attrelid = $1::regclass AND attname = $2"
        return str(await conn.fetchval(query, "inputs", "data"))
    finally:
        await conn.close()


async def test_images_are_stored_without_compression(server_url):
    async with empty_database(server_url) as url:
        await asyncio.to_thread(migrate.upgrade, url)
        assert await _storage_of_input_data(url) == "e"  # EXTERNAL: out of line, never compressed
        await asyncio.to_thread(migrate.downgrade, url, "0003")
        assert await _storage_of_input_data(url) == "x"  # EXTENDED, PostgreSQL's default for bytea


async def test_a_database_where_retention_ran_downgrades_to_base(server_url):
    """Retention leaves an expired job without its image (`input_id` NULL), which the initial schema
    does not allow: the downgrade to it failed on a NOT NULL violation."""
    async with empty_database(server_url) as url:
        await asyncio.to_thread(migrate.upgrade, url)
        conn = await asyncpg.connect(db.asyncpg_dsn(url))
        try:
            job = await conn.fetchval(
                "INSERT INTO jobs (owner, model, params, megapixels, priority, vram_mb, declared_vram_mb,"
                " max_attempts, state, finished_at, expired_at)"
                " VALUES ('o', 'toy', '{}', 1, 0, 1000, 1000, 1, 'succeeded', now(), now()) RETURNING id"
            )
            await conn.execute(
                "INSERT INTO job_events (job_id, kind, attempt) VALUES ($1, 'submitted', 0)", job
            )
        finally:
            await conn.close()
        await asyncio.to_thread(migrate.downgrade, url, "base")
        assert await _table_names(url) == {"alembic_version"}


async def _migrate_process(url: str) -> tuple[int, str]:
    """`gpujobs migrate` against `url` in a process of its own: its exit status and output."""
    env = {**os.environ, "GPUJOBS_DATABASE_URL": url}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app", "migrate", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(errors="replace")


async def test_processes_migrating_at_once_take_turns(server_url):
    """`serve` and a `worker` started together on a new data folder both migrate: the later ones
    wait for the first and find the schema at head. Unlocked, one of three processes died in most
    runs, "column ... already exists" or a duplicate `alembic_version` (revision 0003 commits its
    enum values on their own, so another process saw 0002 and ran 0003 again)."""
    async with empty_database(server_url) as url:
        outcomes = await asyncio.gather(*(_migrate_process(url) for _ in range(3)))
        assert [out for status, out in outcomes if status != 0] == []
        engine = db.create_engine(url, pool_size=1)
        try:
            assert await migrate.current(engine) == migrate.head()
        finally:
            await engine.dispose()
        assert await _diff(url) == []
