"""Database plumbing: the declarative base, one async engine per process, DSN helpers."""

from __future__ import annotations

import asyncio

import asyncpg
from sqlalchemy import MetaData, exc
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase

# Stable constraint names, so autogenerate and downgrades agree with the migrations.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Base of every table."""

    metadata = MetaData(naming_convention=NAMING)


def create_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    """The process's engine: asyncpg, pooled, connections checked before use."""
    return create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        # No pre-ping: it costs three round trips per checkout. A dead connection fails its
        # statement instead; SQLAlchemy then drops the pool and callers retry (db.is_unavailable).
        pool_recycle=1800,
        connect_args={"server_settings": {"application_name": "gpujobs"}},
    )


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker:  # type: ignore[type-arg]
    """Sessions that keep loaded values after commit."""
    return async_sessionmaker(engine, expire_on_commit=False)


def asyncpg_dsn(url: str) -> str:
    """The same database as a plain libpq URL, for asyncpg.connect (LISTEN) and psql."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


_CONNECTION_ERRORS = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.InterfaceError,
    asyncpg.AdminShutdownError,
)


def is_unavailable(error: BaseException) -> bool:
    """True when `error` means the database cannot be reached right now (not a bad statement)."""
    if isinstance(error, exc.DBAPIError):
        if error.connection_invalidated:
            return True
        return isinstance(error.orig, _CONNECTION_ERRORS) or isinstance(
            getattr(error.orig, "__cause__", None), _CONNECTION_ERRORS
        )
    return isinstance(error, (*_CONNECTION_ERRORS, exc.InterfaceError))
