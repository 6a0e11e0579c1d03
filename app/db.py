"""Database plumbing: the declarative base, one async engine per process, DSN helpers."""

from __future__ import annotations

import asyncio
import errno
import functools
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy import MetaData, TextClause, event, exc
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection
from sqlalchemy.util import greenlet_spawn

# Stable constraint names, so autogenerate and downgrades agree with the migrations.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# How long closing a pooled connection may wait for the server's goodbye before dropping it.
CLOSE_TIMEOUT_S = 2.0


class BoundedConnection(asyncpg.Connection):  # type: ignore[misc]
    """asyncpg's connection, whose close gives up after `CLOSE_TIMEOUT_S` and drops the socket.
    SQLAlchemy closes pooled connections (an engine's dispose at a process's exit, a pool renewed
    after an outage) with no timeout: a database host gone silent (no answer, no reset) held the
    exit of an API or worker process for ever, until its supervisor killed it."""

    async def close(self, *, timeout: float | None = None) -> None:  # noqa: ASYNC109 (asyncpg's signature)
        bound = CLOSE_TIMEOUT_S if timeout is None else min(timeout, CLOSE_TIMEOUT_S)
        try:
            await super().close(timeout=bound)
        except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            self.terminate()  # no goodbye came: the socket is dropped, as asyncpg does on error


class Base(DeclarativeBase):
    """Base of every table."""

    metadata = MetaData(naming_convention=NAMING)


def create_engine(
    url: str, *, pool_size: int = 10, name: str = "gpujobs", fixed_plans: bool = False
) -> AsyncEngine:
    """The process's engine: asyncpg, pooled; `name` shows in pg_stat_activity. With
    `fixed_plans`, each prepared statement keeps one generic plan per connection, made without
    sequential scans (see `create_queue_engine`)."""
    # TimeZone UTC: the times PostgreSQL writes as text (a retry's run_after in its event's JSON)
    # came out in the server's zone, which initdb takes from its host's, unlike every other time.
    server_settings = {"application_name": name, "jit": "off", "TimeZone": "UTC"}
    if fixed_plans:
        server_settings.update(plan_cache_mode="force_generic_plan", enable_seqscan="off")
    engine = create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        # No pre-ping: it costs three round trips per checkout. A dead connection fails its
        # statement instead; SQLAlchemy then drops the pool and callers retry (db.is_unavailable).
        # One the server closed (a restart, pg_terminate_backend) is known closed without asking:
        # `_drop_closed` replaces it, and the rest of the pool, at checkout.
        pool_recycle=1800,
        # JIT off: every statement here is short, and JIT compiled the claim whenever its estimated
        # cost passed jit_above_cost (a worker of several models, or the generic plan of its
        # prepared statement): 30-40 ms of LLVM per claim, for a statement that runs in 1-2 ms.
        connect_args={"server_settings": server_settings, "connection_class": BoundedConnection},
    )
    event.listen(engine.sync_engine, "checkout", _drop_closed)
    return engine


def _drop_closed(_dbapi: Any, _record: ConnectionPoolEntry, pooled: PoolProxiedConnection) -> None:
    """Refuse a pooled connection that asyncpg already saw closed, and every connection pooled
    before it: the pool connects afresh. After PostgreSQL restarted, each connection left in the
    pool failed the statement that took it, one 503 (or one failed claim) each."""
    driver = pooled.driver_connection
    if driver is not None and driver.is_closed():
        raise exc.InvalidatePoolError("the server closed this pooled connection")


def create_queue_engine(url: str, *, pool_size: int = 2) -> AsyncEngine:
    """A worker's connections for its claims and its finishes (`JobManager(queue_engine=...)`):
    one claim and one batch of successes at a time, so two connections (a benchmark standing for
    several workers asks for more).

    Their statements keep one generic plan per connection, made without sequential scans:
    - PostgreSQL planned the claim afresh on every run. A prepared statement whose generic plan is
      estimated far dearer than the custom plans for its values never switches to it, and the
      claim's is (unnest of parameter arrays, a probe per model and size class, the placement
      walk). That planning was about a third of the server's CPU per job (0.39-0.43 ms per job,
      0.27-0.30 with a generic plan: claims of 4, tests/bench/README.md, eleventh round).
    - A generic plan made while `jobs` was small (a new service, or after a purge) scanned the
      table, and was kept as the table grew until the next ANALYZE invalidated it: a claim took
      87-108 ms beside 20,000 jobs, a finish 38-69 ms beside 160,000. Both statements only ever
      need their indexes; with sequential scans off, the plan made on a small table is the one a
      large table needs.
    The generic plans read jobs and images by index as the custom ones do
    (tests/integration/test_batching.py checks both). Every other statement keeps PostgreSQL's
    choice, on the main pool.
    """
    return create_engine(url, pool_size=pool_size, name="gpujobs queue", fixed_plans=True)


async def fetch_row(engine: AsyncEngine, statement: TextClause, values: Mapping[str, Any]) -> Any:
    """Run a `text()` statement straight on a pooled asyncpg connection, in autocommit; its first
    row or None. (`fetch_rows` for all of them.)

    For the hot statements (an upload, a claim, finished jobs, the key check): SQLAlchemy sets up a
    result for textual SQL on each execution (column matching, row processing), which for a `jobs`
    row costs about as much CPU as sending the statement, and its `Connection` around the pooled
    one costs more again (`python -m tests.bench.bench_pool`). The row is an asyncpg Record (a
    mapping, JSON already decoded by the dialect's codecs).
    """
    rows = await fetch_rows(engine, statement, values)
    return rows[0] if rows else None


async def fetch_rows(engine: AsyncEngine, statement: TextClause, values: Mapping[str, Any]) -> list[Any]:
    """Run a `text()` statement straight on a pooled asyncpg connection, in autocommit; all its
    rows. A connection error, or a cancel while the statement runs, discards the connection (a
    statement cut off mid-way leaves its connection in an unknown state)."""
    compiled = _driver_sql(statement, engine.dialect)
    pooled = await engine.raw_connection()
    driver = pooled.driver_connection
    assert driver is not None, "a live pooled connection has its driver connection"
    try:
        rows = await driver.fetch(compiled.string, *(values[k] for k in compiled.names))
    except BaseException as exc:
        cut_off = not isinstance(exc, Exception)  # cancelled mid-statement
        if cut_off:  # closed at once: a polite close can fail while the statement is in flight
            driver.terminate()
        if cut_off or _is_connection_error(exc):  # a statement rolled back leaves its connection fine
            await greenlet_spawn(pooled.invalidate, exc)
        raise
    finally:
        await greenlet_spawn(pooled.close)
    return list(rows)


@dataclass(frozen=True, slots=True)
class _Compiled:
    string: str  # with $1, $2... placeholders
    names: tuple[str, ...]  # the bind parameter of each placeholder, in order


@functools.lru_cache(maxsize=64)
def _driver_sql(statement: TextClause, dialect: Dialect) -> _Compiled:
    compiled = statement.compile(dialect=dialect)
    return _Compiled(compiled.string, tuple(compiled.positiontup or ()))


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker:  # type: ignore[type-arg]
    """Sessions that keep loaded values after commit."""
    return async_sessionmaker(engine, expire_on_commit=False)


def asyncpg_dsn(url: str) -> str:
    """The same database as a plain libpq URL, for asyncpg.connect (LISTEN) and psql."""
    plain = make_url(url).set(drivername="postgresql")
    if "ssl" in plain.query:  # asyncpg's keyword; in a URL, asyncpg and libpq read sslmode
        query = {**plain.query, "sslmode": plain.query["ssl"]}
        plain = plain.set(query={k: v for k, v in query.items() if k != "ssl"})
    return plain.render_as_string(hide_password=False)


_CONNECTION_ERRORS = (
    ConnectionError,  # refused, reset, aborted, a broken pipe
    socket.gaierror,  # the host name does not resolve
    asyncio.TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.InterfaceError,
    asyncpg.AdminShutdownError,
    # Every connection taken (53300): so for a while after a restart, when every process reconnects.
    asyncpg.TooManyConnectionsError,
    asyncpg.InternalClientError,  # a connection asyncpg finds mid-operation (after a restart): unusable
)
# PostgreSQL short of a resource (SQLSTATE class 53), which frees up again: not 53400
# (configuration_limit_exceeded), a statement over a configured limit, which fails again when sent again.
DISK_FULL, OUT_OF_MEMORY = "53100", "53200"
_SHORTAGES = frozenset({"53000", DISK_FULL, OUT_OF_MEMORY, "53300"})
# Statements PostgreSQL failed to break a deadlock (40P01) or a serialization conflict (40001).
_ROLLED_BACK = (asyncpg.DeadlockDetectedError, asyncpg.SerializationError)
# Other OSErrors count only with one of these numbers and no file name: a socket that could not
# connect (ENOENT: the server's unix socket is gone). A full disk, an I/O error or a missing file
# (which carries its name) is this host's trouble: taken for an outage, it left jobs running, their
# writes retried and leases renewed, for ever.
_NETWORK_ERRNOS = frozenset(
    {
        errno.ENOENT,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EHOSTUNREACH,
        errno.EHOSTDOWN,
        errno.ETIMEDOUT,
        errno.ENOTCONN,
        errno.EADDRNOTAVAIL,
    }
)


# What a statement may fail with, an outage or not (a statement the server cancelled at its
# statement_timeout or lock_timeout, say): for a reader that answers with what it read before.
ERRORS = (
    exc.SQLAlchemyError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)


def is_unavailable(error: BaseException) -> bool:
    """True when `error` means the database cannot be reached right now (not a bad statement).

    A connection error may come wrapped: in SQLAlchemy's DBAPIError (`orig`), and in the dialect's
    own DBAPI error with asyncpg's as its cause. So does a new pooled connection refused by a server
    still starting up (57P03), straight out of `engine.raw_connection()`, unwrapped by SQLAlchemy.
    A pool with no connection free within its timeout (a server that hangs, a lock held) counts too:
    the statement never reached PostgreSQL, and waiting is what helps; so does a statement PostgreSQL
    failed to break a deadlock, which wrote nothing, and one it refused short of disk space, memory
    or connections (`shortage`)."""
    if isinstance(error, exc.TimeoutError):  # the pool's wait (sqlalchemy.exc), not a statement's
        return True
    if shortage(error) is not None:
        return True
    if isinstance(error, exc.DBAPIError):
        return error.connection_invalidated or _is_connection_error(error.orig) or _rolled_back(error.orig)
    return isinstance(error, exc.InterfaceError) or _is_connection_error(error) or _rolled_back(error)


def shortage(error: BaseException | None) -> str | None:
    """The SQLSTATE of PostgreSQL short of a resource that comes back (class 53: its disk full,
    out of memory, every connection taken) behind `error`, however wrapped; None for any other
    error. The statement wrote nothing, and once the operator (or time) frees room it goes through:
    passing trouble, not the client's nor the job's."""
    for found in (error, getattr(error, "orig", None)):
        for cause in (found, getattr(found, "__cause__", None)):
            state: str | None = getattr(cause, "sqlstate", None)
            if isinstance(cause, asyncpg.PostgresError) and state in _SHORTAGES:
                return state
    return None


def _rolled_back(error: BaseException | None) -> bool:
    """`error`, or what caused it, is PostgreSQL failing a statement to break a deadlock or a
    serialization conflict: it wrote nothing, and sent again it goes through (waiting helps)."""
    return isinstance(error, _ROLLED_BACK) or isinstance(getattr(error, "__cause__", None), _ROLLED_BACK)


def _is_connection_error(error: BaseException | None) -> bool:
    """`error`, or what caused it, is one of the errors of a connection that is not there."""
    return _lost_connection(error) or _lost_connection(getattr(error, "__cause__", None))


def _lost_connection(error: BaseException | None) -> bool:
    if isinstance(error, _CONNECTION_ERRORS):
        return True
    return isinstance(error, OSError) and error.filename is None and error.errno in _NETWORK_ERRNOS
