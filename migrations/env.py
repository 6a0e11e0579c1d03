"""Alembic environment (async, asyncpg). The URL comes from the caller or GPUJOBS_DATABASE_URL."""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from app import migrate, tables
from app.db import Base

assert tables  # imported for its side effect: the tables register on Base.metadata

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    """The database to migrate: set by `gpujobs migrate`, else from the environment."""
    url = config.attributes.get("url") or os.environ.get("GPUJOBS_DATABASE_URL")
    if not url:
        raise SystemExit("set GPUJOBS_DATABASE_URL, or run `gpujobs migrate`")
    from app.settings import Settings

    return Settings(database_url=url).database_url or url


def _run(connection: Connection) -> None:
    # One process migrates at a time (app.migrate.MIGRATE_LOCK_KEY). The lock is the session's, not
    # a transaction's: revision 0003 commits part of its work on its own, and a transaction's lock
    # would be let go there, for another process to run 0003 again.
    lock = {"key": migrate.MIGRATE_LOCK_KEY}
    migrate.take_lock(connection)  # the wait ends here; the migrations' own transaction starts after it
    try:
        context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
        with context.begin_transaction():
            context.run_migrations()
            migrate.record_oldest_code(connection, context.script)  # in the same transaction as the revision
    finally:
        connection.rollback()  # a failed migration's transaction, so that the unlock can run
        connection.execute(text("SELECT pg_advisory_unlock(:key)"), lock)
        connection.commit()


async def _run_async() -> None:
    engine = create_async_engine(_url())
    async with engine.connect() as connection:
        await connection.run_sync(_run)
    await engine.dispose()


def run_migrations_online() -> None:
    """Migrate on a connection handed in by the caller, or open our own."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
    else:
        asyncio.run(_run_async())


if context.is_offline_mode():
    left: list[str] = []  # the revision the last step leaves (online, the record reads it back)

    def _step_done(*, heads: set[str], **_: object) -> None:
        left[:] = sorted(heads)

    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True, on_version_apply=_step_done
    )
    with context.begin_transaction():
        context.run_migrations()
        if len(left) == 1:  # none: taken down to nothing
            context.execute(migrate.record(left[0], context.script))
else:
    run_migrations_online()
