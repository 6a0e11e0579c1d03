"""Which errors mean "the database cannot be reached": real connection failures, not this host's
own file-system trouble (which once left jobs running, their leases renewed, for ever)."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import asyncpg
import pytest

from app import db


async def connect_error(dsn: str) -> BaseException:
    """What asyncpg raises when it cannot connect to `dsn`."""
    with pytest.raises(Exception) as caught:
        await asyncpg.connect(dsn, timeout=5)
    return caught.value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_refused_tcp_connection_is_unavailable() -> None:
    refused = await connect_error(f"postgresql://postgres@127.0.0.1:{free_port()}/x")
    assert isinstance(refused, ConnectionRefusedError) and db.is_unavailable(refused)


async def test_a_missing_unix_socket_is_unavailable(tmp_path: Path) -> None:
    """The embedded server is down: its socket file is gone (FileNotFoundError, but of no file name)."""
    missing = await connect_error(f"postgresql://postgres@/x?host={tmp_path / 'no-server'}")
    assert isinstance(missing, FileNotFoundError) and db.is_unavailable(missing)


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        BrokenPipeError(errno.EPIPE, "Broken pipe"),
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        TimeoutError(),
        OSError(errno.EHOSTUNREACH, "No route to host"),
        OSError(errno.ENETUNREACH, "Network is unreachable"),
    ],
    ids=repr,
)
def test_network_errors_are_unavailable(error: OSError) -> None:
    assert db.is_unavailable(error)
    wrapped = RuntimeError("while talking to the database")
    wrapped.__cause__ = error
    assert db.is_unavailable(wrapped)


def file_error(tmp_path: Path) -> OSError:
    with pytest.raises(OSError) as caught:
        (tmp_path / "gone" / "file").read_bytes()
    return caught.value


@pytest.mark.parametrize(
    "make",
    [
        file_error,
        lambda _: OSError(errno.ENOSPC, "No space left on device"),
        lambda _: OSError(errno.EIO, "Input/output error"),
        lambda _: PermissionError(errno.EACCES, "Permission denied", "results/x"),
        lambda _: IsADirectoryError(errno.EISDIR, "Is a directory", "results/x"),
        lambda _: ProcessLookupError(errno.ESRCH, "No such process"),
    ],
    ids=["missing file", "disk full", "I/O error", "permission", "a folder", "no such process"],
)
def test_this_hosts_own_troubles_are_not(make, tmp_path: Path) -> None:
    error = make(tmp_path)
    assert not db.is_unavailable(error)
    wrapped = RuntimeError("while storing results")
    wrapped.__cause__ = error
    assert not db.is_unavailable(wrapped)


async def test_a_pool_with_no_connection_free_in_time_is_unavailable(database_url: str) -> None:
    """Every pooled connection busy past the pool's timeout (the server hangs, a lock is held): a
    worker's writes waited on SQLAlchemy's TimeoutError as a failure of their own, not an outage."""
    from sqlalchemy.ext.asyncio import create_async_engine

    # One connection, and a wait of 0.2 s for it (the service's pools wait 30 s).
    engine = create_async_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    try:
        async with engine.connect():
            with pytest.raises(Exception) as caught:
                async with engine.connect():
                    pass
        assert db.is_unavailable(caught.value), repr(caught.value)
    finally:
        await engine.dispose()


def test_a_connection_asyncpg_finds_mid_operation_is_unavailable() -> None:
    """After a database restart, a worker's claim met a pooled connection asyncpg still took for busy
    with an earlier operation: `InternalClientError: cannot switch to state 12; another operation
    (2) is in progress` (test_sched_outage, about 1 run in 20). Not taken for an outage, it ended
    the worker's claim loop, and the worker stopped, and `fetch_rows` put the connection back in the
    pool. Such a connection cannot be used: an outage to callers, who retry, and `fetch_rows`
    discards it."""
    error = asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress")
    assert db.is_unavailable(error)
